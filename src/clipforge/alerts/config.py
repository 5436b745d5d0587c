"""The `alerts:` section of params.yaml: thresholds and delivery limits.

Webhook URLs are deliberately *not* here: they are credentials and come from the environment
(see `targets.py`), so that params.yaml, which is committed and saved next to every output,
never holds one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AlertsConfig:
    """Thresholds of the alert rules and limits of webhook delivery.

    After `max_consecutive_nonfinite` non-finite steps the run stops with a clear error; there
    is no in-process rollback (see docs/alerts.md, "Why stop and not roll back").
    """

    loss_spike_factor: float = 3.0
    """Alert when a step's loss exceeds this many times its moving average. Must be > 1."""

    loss_ema_beta: float = 0.98
    """Smoothing of the loss moving average (exponential; ~1/(1-beta) steps). In (0, 1)."""

    loss_spike_warmup_steps: int = 100
    """Finite losses this process must see before the spike rule is armed. Counted from the
    monitor's start, so a resumed run warms up again. >= 1."""

    max_consecutive_nonfinite: int = 5
    """Non-finite steps (loss or gradient norm) in a row after which the run must stop. >= 1."""

    gpu_temp_celsius: float = 85.0
    """Alert when a GPU's core temperature reaches this. In [40, 120]."""

    gpu_poll_seconds: float = 30.0
    """Seconds between two NVML readings of the node's GPUs. In (0, 3600]."""

    stall_timeout_seconds: float = 900.0
    """Alert when no step completed (and no heartbeat came) for this long: a hung collective
    or a dead GPU. Must exceed the longest step, checkpoint save or eval between heartbeats."""

    min_seconds_between_repeats: float = 600.0
    """An alert of the same rule (and GPU) within this many seconds of the last one sent is
    not sent again, only counted and mentioned in the next one. >= 0."""

    max_messages_per_window: int = 30
    """At most this many webhook messages per `rate_window_seconds`, all rules together
    (run started/finished/failed/restarted are never held back). >= 1."""

    rate_window_seconds: float = 3600.0
    """The window of `max_messages_per_window`. > 0."""

    max_retries: int = 3
    """Further attempts after a failed delivery (network error, timeout, HTTP 429 or 5xx). >= 0."""

    retry_backoff_seconds: float = 2.0
    """Wait before the first retry; doubled for each next one. >= 0."""

    http_timeout_seconds: float = 10.0
    """Timeout of one webhook request (connect and each read). > 0."""

    queue_size: int = 100
    """Messages waiting per webhook target; when full, the oldest is dropped (and counted). >= 1."""

    flush_timeout_seconds: float = 30.0
    """How long `AlertMonitor.close()` waits for queued messages (e.g. "run finished") to be
    delivered before giving up on them. >= 0."""

    def __post_init__(self) -> None:
        _check(self, "loss_spike_factor", lambda v: v > 1, "> 1")
        _check(self, "loss_ema_beta", lambda v: 0 < v < 1, "in (0, 1)")
        _check(self, "loss_spike_warmup_steps", lambda v: v >= 1, ">= 1", integer=True)
        _check(self, "max_consecutive_nonfinite", lambda v: v >= 1, ">= 1", integer=True)
        _check(self, "gpu_temp_celsius", lambda v: 40 <= v <= 120, "in [40, 120]")
        _check(self, "gpu_poll_seconds", lambda v: 0 < v <= 3600, "in (0, 3600]")
        _check(self, "stall_timeout_seconds", lambda v: v > 0, "> 0")
        _check(self, "min_seconds_between_repeats", lambda v: v >= 0, ">= 0")
        _check(self, "max_messages_per_window", lambda v: v >= 1, ">= 1", integer=True)
        _check(self, "rate_window_seconds", lambda v: v > 0, "> 0")
        _check(self, "max_retries", lambda v: v >= 0, ">= 0", integer=True)
        _check(self, "retry_backoff_seconds", lambda v: v >= 0, ">= 0")
        _check(self, "http_timeout_seconds", lambda v: v > 0, "> 0")
        _check(self, "queue_size", lambda v: v >= 1, ">= 1", integer=True)
        _check(self, "flush_timeout_seconds", lambda v: v >= 0, ">= 0")


def _check(
    config: AlertsConfig,
    name: str,
    ok: Callable[[float], bool],
    allowed: str,
    *,
    integer: bool = False,
) -> None:
    value = getattr(config, name)
    # bool is an int subclass; `true` in YAML must not silently become 1.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"alerts.{name} must be {kind} {allowed}, got {value!r}")
    if integer and not isinstance(value, int):
        raise ValueError(f"alerts.{name} must be an integer {allowed}, got {value!r}")
    if not math.isfinite(value) or not ok(value):
        raise ValueError(f"alerts.{name} must be {allowed}, got {value!r}")
