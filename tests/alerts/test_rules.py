"""Step rules: loss spike after warm-up, non-finite counting and the stop after M in a row."""

from __future__ import annotations

import math

from clipforge.alerts.config import AlertsConfig
from clipforge.alerts.rules import StepRules

NAN, INF = float("nan"), float("inf")


def rules(**overrides) -> StepRules:
    values = dict(
        loss_spike_factor=3.0,
        loss_ema_beta=0.5,
        loss_spike_warmup_steps=3,
        max_consecutive_nonfinite=3,
    )
    values.update(overrides)
    return StepRules(AlertsConfig(**values))


def run(r: StepRules, losses, grad_norm=1.0):
    """Drive the rules like the loop does; returns the loss verdicts."""
    verdicts = []
    for step, loss in enumerate(losses):
        verdict = r.check_loss(step, loss)
        verdicts.append(verdict)
        if not verdict.skip:
            r.check_update(step, grad_norm)
    return verdicts


def test_no_spike_during_warmup():
    """A huge loss before warm-up_steps finite losses were seen raises nothing."""
    verdicts = run(rules(loss_spike_warmup_steps=3), [1.0, 1.0, 100.0])
    assert not any(v.loss_spike or v.findings for v in verdicts)


def test_spike_after_warmup_alerts_once_per_spike():
    """Above k x average after warm-up: flagged on every spiking step, alerted when it starts;
    a normal loss re-arms the rule."""
    verdicts = run(rules(), [2.0, 2.0, 2.0, 7.0, 8.0, 2.0, 9.0])
    assert [v.loss_spike for v in verdicts] == [False, False, False, True, True, False, True]
    alerted = [i for i, v in enumerate(verdicts) if any(f.rule == "loss_spike" for f in v.findings)]
    assert alerted == [3, 6]
    assert not any(v.skip for v in verdicts), "a spike is reported, the step is still applied"


def test_below_factor_is_not_a_spike():
    """A loss just under k x its average is normal training noise."""
    verdicts = run(rules(), [2.0, 2.0, 2.0, 5.9])
    assert not verdicts[-1].loss_spike


def test_spiking_losses_do_not_raise_the_baseline():
    """During a sustained explosion the average stays put, so the explosion stays a spike."""
    r = rules()
    run(r, [2.0, 2.0, 2.0] + [50.0] * 20)
    assert math.isclose(r.spike.average, 2.0)


def test_nonfinite_loss_is_skipped_counted_and_alerted():
    """NaN or inf loss: verdict says skip, counters go up, a warning finding is produced."""
    r = rules(max_consecutive_nonfinite=5)
    for step, loss in enumerate([NAN, INF]):
        verdict = r.check_loss(step, loss)
        assert verdict.skip and not verdict.stop
        assert [f.rule for f in verdict.findings] == ["non_finite"]
        assert verdict.findings[0].severity == "warning"
    assert verdict.consecutive_nonfinite == 2 and verdict.total_nonfinite == 2


def test_training_recovers_after_a_nonfinite_step():
    """A finite step after a NaN one resets the streak; the total keeps the history."""
    r = rules(max_consecutive_nonfinite=2)
    verdicts = run(r, [2.0, NAN, 2.0, NAN, 2.0, NAN, 2.0])
    assert not any(v.stop for v in verdicts)
    assert (r.nonfinite.consecutive, r.nonfinite.total) == (0, 3)


def test_m_consecutive_nonfinite_steps_stop_the_run():
    """The M-th non-finite step in a row says stop, with a critical finding and a clear message."""
    r = rules(max_consecutive_nonfinite=3)
    verdicts = run(r, [2.0, NAN, NAN, NAN])
    assert [v.stop for v in verdicts] == [False, False, False, True]
    last = verdicts[-1]
    assert "non_finite_stop" in [f.rule for f in last.findings]
    assert [f.severity for f in last.findings if f.rule == "non_finite_stop"] == ["critical"]
    assert "alerts.max_consecutive_nonfinite=3" in last.message and "stops" in last.message


def test_nonfinite_gradient_norm_counts_toward_the_streak():
    """A non-finite gradient norm after the optimizer step counts like a non-finite loss."""
    r = rules(max_consecutive_nonfinite=2)
    assert not r.check_loss(0, 2.0).skip
    first = r.check_update(0, NAN)
    assert first.skip and not first.stop
    assert not r.check_loss(1, 2.0).skip
    assert r.check_update(1, INF).stop


def test_missing_gradient_norm_is_a_good_step():
    """grad_norm=None (not computed) completes the step and resets the streak."""
    r = rules(max_consecutive_nonfinite=2)
    r.check_loss(0, NAN)
    r.check_loss(1, 2.0)
    assert r.check_update(1, None).consecutive_nonfinite == 0
