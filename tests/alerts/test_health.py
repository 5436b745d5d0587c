"""Training-health rules fed injected readings: temperature pinned or collapsed, in-batch
accuracy stuck near chance after warm-up, recall falling K validations in a row; each once per
episode, each off by its switch, and only rank 0's monitor alerts."""

from __future__ import annotations

import pytest

from clipforge.alerts import events
from clipforge.alerts.health import HealthReading, HealthRules
from clipforge.alerts.monitor import AlertMonitor
from tests.support.webhooks import fast_config


def rules(**config) -> HealthRules:
    return HealthRules(fast_config(health_patience_logs=3, **config))


def fired(rules: HealthRules, readings) -> list[tuple[int, str]]:
    return [(r.step, f.rule) for r in readings for f in rules.observe(r)]


def scale(step: int, value: float, cap: float = 100.0) -> HealthReading:
    return HealthReading(step=step, logit_scale=value, max_logit_scale=cap)


def test_temperature_pinned_at_the_cap_alerts_after_patience_once():
    """At >= 99% of the cap three readings in a row: one alert; it re-arms after leaving."""
    values = [50, 99.5, 100, 100, 100, 100, 80, 100, 100, 100]
    got = fired(rules(), [scale(s, v) for s, v in enumerate(values)])
    assert got == [(3, events.TEMPERATURE_PINNED), (9, events.TEMPERATURE_PINNED)]


def test_temperature_just_below_the_pinned_fraction_is_normal():
    assert fired(rules(), [scale(s, 98.9) for s in range(10)]) == []


def test_temperature_collapsing_to_the_floor_alerts():
    """Falling to logit_scale_floor or below, held three readings: collapsed."""
    values = [14.3, 5.0, 2.0, 1.5, 1.1]
    got = fired(rules(logit_scale_floor=2.0), [scale(s, v) for s, v in enumerate(values)])
    assert got == [(4, events.TEMPERATURE_COLLAPSED)]


def acc(step: int, value: float, batch: int = 100) -> HealthReading:
    return HealthReading(step=step, accuracy=value, batch_size=batch)


def test_accuracy_near_chance_alerts_only_after_warmup():
    """Chance is 1/B = 0.01; below 2x chance during warm-up is expected, after it an alert."""
    r = rules(chance_accuracy_warmup_steps=10, chance_accuracy_factor=2.0)
    readings = [acc(s, 0.012) for s in (2, 4, 6, 8, 10, 12, 14, 16)]
    assert fired(r, readings) == [(16, events.ACCURACY_AT_CHANCE)]


def test_accuracy_above_the_threshold_never_alerts():
    """Twice chance and more is learning (here 0.021 > 2/100)."""
    r = rules(chance_accuracy_warmup_steps=0)
    assert fired(r, [acc(s, 0.021) for s in range(1, 20)]) == []


def test_recall_falling_k_validations_in_a_row_alerts():
    """Three falls in a row (K=3) alert, with the trail in the message; a rise resets."""
    r = rules(recall_decline_validations=3)
    recalls = [0.30, 0.35, 0.34, 0.33, 0.36, 0.35, 0.34, 0.33, 0.32]
    got = [(i, f) for i, x in enumerate(recalls) for f in r.observe_validation(i, x)]
    assert [(i, f.rule) for i, f in got] == [(7, events.RECALL_DECLINING)]
    assert "0.36 (step 4) -> 0.35 (step 5) -> 0.34 (step 6) -> 0.33 (step 7)" in got[0][1].message


def test_flat_recall_is_not_a_decline():
    r = rules(recall_decline_validations=2)
    assert [f for i in range(6) for f in r.observe_validation(i, 0.4)] == []


@pytest.mark.parametrize(
    "switch", ["temperature_alerts", "chance_accuracy_alerts", "recall_decline_alerts"]
)
def test_each_rule_is_off_by_its_switch(switch):
    """With its switch off, a rule stays silent on readings that would make it fire."""
    r = rules(chance_accuracy_warmup_steps=0, recall_decline_validations=1, **{switch: False})
    got = {rule for _, rule in fired(r, [scale(s, 100) for s in range(5)])}
    got |= {rule for _, rule in fired(r, [acc(s, 0.0) for s in range(1, 6)])}
    got |= {f.rule for i, x in enumerate([0.5, 0.4]) for f in r.observe_validation(i, x)}
    off = {
        "temperature_alerts": events.TEMPERATURE_PINNED,
        "chance_accuracy_alerts": events.ACCURACY_AT_CHANCE,
        "recall_decline_alerts": events.RECALL_DECLINING,
    }[switch]
    assert off not in got and len(got) == 2


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_alerts_on_health(rank):
    """Every rank may feed the monitor; only rank 0's turns findings into alerts."""
    monitor = AlertMonitor(
        fast_config(health_patience_logs=1, recall_decline_validations=1),
        "run-1",
        rank=rank,
        local_rank=1,
    )
    monitor.check_health(scale(5, 100.0))
    monitor.check_validation(6, 0.5)
    monitor.check_validation(7, 0.4)
    tags = [e.tag for e in monitor.drain_events()]
    expected = ["alerts/temperature_pinned", "alerts/recall_declining"] if rank == 0 else []
    assert tags == expected
