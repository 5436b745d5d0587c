"""AlertMonitor end to end, against a real webhook server on 127.0.0.1.

`toy_loop` has the control flow the training loop will have (check the loss before backward,
skip or stop on the verdict, check the gradient norm after the step); its "update" is a sum,
so the effect of a skipped step is visible.
"""

from __future__ import annotations

import json
import logging

import pytest

from clipforge.alerts.monitor import AlertMonitor
from clipforge.alerts.rules import NonFiniteTrainingError
from clipforge.alerts.targets import ENV_WEBHOOKS, parse_targets
from tests.support.webhooks import SECRET, eventually, fast_config

NAN = float("nan")
LOSSES = [2.0, 2.1, 1.9, NAN, 2.0, 1.8, 1.7]


def monitor_for(*entries, **config) -> AlertMonitor:
    return AlertMonitor(
        fast_config(**config), "run-1", targets=parse_targets(entries, source="test")
    )


def toy_loop(monitor: AlertMonitor, losses, grad_norm=1.0) -> list[float]:
    weights, history = 0.0, []
    for step, loss in enumerate(losses):
        verdict = monitor.check_loss(step, loss)
        if verdict.stop:
            raise NonFiniteTrainingError(verdict.message)
        if verdict.skip:
            continue
        weights += loss
        if monitor.check_update(step, grad_norm).stop:
            raise NonFiniteTrainingError("gradient norm")
        history.append(weights)
    return history


def test_nan_step_is_skipped_alerted_as_json_and_training_recovers(webhook_server):
    """A NaN loss: the update is skipped, a generic JSON alert with the documented fields
    arrives, and the following steps train normally."""
    with monitor_for(webhook_server.url()) as monitor:
        history = toy_loop(monitor, LOSSES)
        body = _wait_rule(webhook_server, "non_finite")[0].body
    assert history == pytest.approx([2.0, 4.1, 6.0, 8.0, 9.8, 11.5])
    assert body["rule"] == "non_finite" and body["severity"] == "warning"
    assert body["run_id"] == "run-1" and body["step"] == 3
    assert "loss is nan" in body["message"] and body["time"].endswith("Z")


def test_m_consecutive_nan_steps_stop_with_a_clear_error(webhook_server):
    """Three NaN losses in a row (M=3): the loop raises NonFiniteTrainingError naming the
    setting; the critical stop alert and the run failure are both delivered."""
    monitor = monitor_for(webhook_server.url(), max_consecutive_nonfinite=3)
    with pytest.raises(NonFiniteTrainingError, match="max_consecutive_nonfinite=3"), monitor:
        toy_loop(monitor, [2.0, NAN, NAN, NAN, 2.0])
    rules = [r.body["rule"] for r in webhook_server.received]
    assert "non_finite_stop" in rules and rules[-1] == "run_failed"
    stop = next(r.body for r in webhook_server.received if r.body["rule"] == "non_finite_stop")
    assert stop["severity"] == "critical" and stop["step"] == 3


def test_slow_webhook_does_not_block_the_loop(webhook_server):
    """The receiver holds each request until released; the run's calls all return before it
    answers."""
    webhook_server.held = True
    monitor = monitor_for(webhook_server.url()).start()
    monitor.run_started({"lr": 5e-4})
    toy_loop(monitor, LOSSES)
    monitor.run_finished({"loss": 1.7})
    assert webhook_server.num_answered == 0, "a call waited for the webhook"
    webhook_server.release.set()
    monitor.close()
    assert webhook_server.num_answered >= 1


@pytest.mark.parametrize("receiver", ["down", "http500"])
def test_failing_webhook_changes_nothing_in_training(receiver, webhook_server, dead_url, caplog):
    """With the webhook down or answering 500, the loop's results and verdicts equal those of a
    run without alerts, and the failed deliveries are in the log."""
    caplog.set_level(logging.INFO, logger="clipforge.alerts")
    url = dead_url if receiver == "down" else webhook_server.url()
    webhook_server.statuses.extend([500] * 100)
    with monitor_for() as quiet:
        expected = toy_loop(quiet, LOSSES)
    with monitor_for(url, max_retries=1) as noisy:
        assert toy_loop(noisy, LOSSES) == expected
    assert "retrying" in caplog.text and "NOT delivered" in caplog.text


def test_flapping_rule_sends_one_message_and_logs_the_rest(webhook_server, caplog):
    """A loss spiking every other step for 200 steps sends one spike message; the others are
    logged as held back by the rate limit."""
    caplog.set_level(logging.INFO, logger="clipforge.alerts")
    losses = [2.0] * 3 + [2.0, 50.0] * 100
    with monitor_for(webhook_server.url()) as monitor:
        toy_loop(monitor, losses)
    spikes = [r for r in webhook_server.received if r.body["rule"] == "loss_spike"]
    assert len(spikes) == 1
    assert "held back (99 so far): repeat of loss_spike" in caplog.text


def test_stall_alert_then_recovery(webhook_server):
    """No step for longer than stall_timeout_seconds (0.5 s) sends a critical stall alert with
    the last step; the next step sends the recovery."""
    with monitor_for(webhook_server.url(), stall_timeout_seconds=0.5) as monitor:
        toy_loop(monitor, [2.0, 2.0])
        stall = next(r.body for r in _wait_rule(webhook_server, "stall"))
        monitor.check_loss(2, 2.0)
        recovered = next(r.body for r in _wait_rule(webhook_server, "stall_recovered"))
    assert stall["severity"] == "critical" and stall["step"] == 1
    assert "no training step completed" in stall["message"]
    assert recovered["step"] == 2


def test_lifecycle_messages_pass_a_full_rate_limit(webhook_server):
    """Started, restarted, finished are delivered even when the message window is used up."""
    with monitor_for(webhook_server.url(), max_messages_per_window=1) as monitor:
        monitor.run_started({"world_size": 4})
        monitor.run_restarted(2, from_step=1000)
        toy_loop(monitor, [2.0, NAN, 2.0, NAN])
        monitor.run_finished({"recall@1": 0.51})
    rules = [r.body["rule"] for r in webhook_server.received]
    assert {"run_started", "run_restarted", "run_finished"} <= set(rules)
    others = [rule for rule in rules if not rule.startswith("run_")]
    assert len(others) == 1, "two NaN steps (and maybe 'no NVML'), one slot in the window"


def test_drain_events_gives_alerts_and_delivery_outcomes_for_tensorboard(webhook_server):
    """drain_events returns alert texts tagged alerts/<rule> and the delivery outcomes, once."""
    with monitor_for(webhook_server.url("slack")) as monitor:
        toy_loop(monitor, LOSSES)
        eventually(lambda: len(webhook_server.received) >= 2, "two deliveries")
    events = monitor.drain_events()
    tags = [e.tag for e in events]
    assert "alerts/non_finite" in tags and "alerts/delivery" in tags
    nan_event = next(e for e in events if e.tag == "alerts/non_finite")
    assert nan_event.step == 3 and "loss is nan" in nan_event.text
    assert any("delivered to slack:" in e.text for e in events if e.tag == "alerts/delivery")
    assert monitor.drain_events() == []


def test_secret_url_never_leaks(webhook_server, dead_url, caplog):
    """Across success, HTTP 500 and connection-refused paths, the secret part of the URL is in
    no log line, TensorBoard event, webhook message, or repr/str of config, targets, monitor,
    even when an error message or the run info quotes the URL."""
    caplog.set_level(logging.DEBUG)
    webhook_server.statuses.extend([200, 500, 500, 500])
    monitor = monitor_for(
        webhook_server.url("feishu"),
        webhook_server.url("slack"),
        webhook_server.url(),
        dead_url,
        max_retries=1,
    )
    with monitor:
        monitor.run_started({"lr": 5e-4, "note": f"alerts go to {dead_url}"})
        toy_loop(monitor, LOSSES)
        monitor.run_failed(RuntimeError(f"boom while posting to {webhook_server.url()}"))
    texts = [caplog.text, repr(monitor), str(monitor), repr(monitor.config), repr(monitor._targets)]
    texts += [e.text for e in monitor.drain_events()]
    texts += [json.dumps(r.body) for r in webhook_server.received]
    assert any('"note": "alerts go to' in text for text in texts), "generic details arrived"
    assert any("run_failed" in text and "boom" in text for text in texts)
    assert all(SECRET not in text for text in texts)


def test_other_ranks_decide_alike_but_stay_silent(webhook_server, monkeypatch):
    """A rank that is neither global nor local rank 0 gets the same verdicts, reads no webhook
    configuration and sends nothing."""
    monkeypatch.setenv(ENV_WEBHOOKS, "not a url")
    with pytest.raises(ValueError, match=ENV_WEBHOOKS):
        AlertMonitor.from_environment(fast_config(), "run-1", rank=0, local_rank=0)
    other = AlertMonitor.from_environment(fast_config(), "run-1", rank=5, local_rank=1)
    with monitor_for(webhook_server.url()) as first, other:
        assert toy_loop(first, LOSSES) == toy_loop(other, LOSSES)
    assert other.drain_events() == []
    assert [r.body["rule"] for r in webhook_server.received].count("non_finite") == 1


def _wait_rule(server, rule):
    eventually(lambda: any(r.body["rule"] == rule for r in server.received), f"a {rule} alert")
    return [r for r in server.received if r.body["rule"] == rule]


def test_tensorboard_text_holds_alerts_but_no_secret(webhook_server, tmp_path):
    """Drained events written with SummaryWriter.add_text read back as alerts/<rule> text, and
    the event files contain no webhook secret."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    with monitor_for(webhook_server.url("feishu")) as monitor:
        toy_loop(monitor, LOSSES)
        _wait_rule_feishu(webhook_server, "non_finite")
    writer = SummaryWriter(str(tmp_path))
    for event in monitor.drain_events():
        writer.add_text(event.tag, event.text, event.step)
    writer.close()
    accumulator = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()["tensors"]
    assert any(tag.startswith("alerts/non_finite") for tag in tags)
    assert any(tag.startswith("alerts/delivery") for tag in tags)
    for path in tmp_path.iterdir():
        assert SECRET.encode() not in path.read_bytes()


def _wait_rule_feishu(server, rule):
    eventually(
        lambda: any(rule in r.body["content"]["text"] for r in server.received), f"a {rule} alert"
    )
