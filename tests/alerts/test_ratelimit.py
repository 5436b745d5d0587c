"""The gate between alerts and webhook messages: de-duplication and rate limits (fake clock)."""

from __future__ import annotations

from clipforge.alerts.ratelimit import AlertGate


def gate(**overrides) -> AlertGate:
    values = dict(min_seconds_between_repeats=60.0, max_messages_per_window=3, window_seconds=600.0)
    values.update(overrides)
    return AlertGate(**values)


def test_repeats_are_held_back_and_counted_then_reported():
    """A repeat within the interval is held back; the next one sent carries the count."""
    g = gate()
    assert g.admit("gpu_temperature", "gpu0", now=0.0).send
    held = [g.admit("gpu_temperature", "gpu0", now=t) for t in (1.0, 2.0, 59.0)]
    assert [a.send for a in held] == [False, False, False]
    assert held[-1].num_suppressed_before == 3 and "min_seconds_between_repeats" in held[-1].reason
    later = g.admit("gpu_temperature", "gpu0", now=61.0)
    assert later.send and later.num_suppressed_before == 3


def test_keys_are_independent():
    """GPU 0 being hot does not hold back GPU 1's alert."""
    g = gate()
    assert g.admit("gpu_temperature", "gpu0", now=0.0).send
    assert g.admit("gpu_temperature", "gpu1", now=1.0).send


def test_window_caps_all_rules_together():
    """At most max_messages_per_window messages per window, whatever the rules."""
    g = gate(max_messages_per_window=2)
    assert g.admit("a", "", now=0.0).send and g.admit("b", "", now=1.0).send
    refused = g.admit("c", "", now=2.0)
    assert not refused.send and "max_messages_per_window" in refused.reason
    assert g.admit("c", "", now=600.5).send  # the first two left the window


def test_lifecycle_messages_always_pass_and_use_no_budget():
    """Exempt messages pass a full window and do not consume it."""
    g = gate(max_messages_per_window=1)
    assert g.admit("a", "", now=0.0).send
    assert g.admit("run_finished", "", now=1.0, exempt=True).send
    assert g.admit("run_finished", "", now=2.0, exempt=True).send
    assert not g.admit("b", "", now=3.0).send
