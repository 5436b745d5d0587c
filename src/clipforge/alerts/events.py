"""What an alert is, independent of where it is sent or shown."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

SEVERITIES = ("info", "warning", "critical")

# Rule names: they appear in messages, in the generic JSON `rule` field, as TensorBoard tags
# (alerts/<rule>) and in the table of docs/alerts.md. Renaming one is a user-visible change.
RUN_STARTED = "run_started"
RUN_FINISHED = "run_finished"
RUN_FAILED = "run_failed"
RUN_RESTARTED = "run_restarted"
RUN_STOPPED = "run_stopped"
LOSS_SPIKE = "loss_spike"
NON_FINITE = "non_finite"
NON_FINITE_STOP = "non_finite_stop"
STALL = "stall"
STALL_RECOVERED = "stall_recovered"
GPU_TEMPERATURE = "gpu_temperature"
GPU_THROTTLE = "gpu_throttle"
GPU_ECC = "gpu_ecc"
GPU_READ_FAILED = "gpu_read_failed"
GPU_MONITOR_UNAVAILABLE = "gpu_monitor_unavailable"
DISK_SPACE_LOW = "disk_space_low"
CHECKPOINT_DAMAGED = "checkpoint_damaged"
STORE_UNREACHABLE = "store_unreachable"
STORE_SYNC_LAG = "store_sync_lag"
STORE_CAUGHT_UP = "store_caught_up"
TEMPERATURE_PINNED = "temperature_pinned"
TEMPERATURE_COLLAPSED = "temperature_collapsed"
ACCURACY_AT_CHANCE = "accuracy_at_chance"
RECALL_DECLINING = "recall_declining"
HANG = "hang"
GPU_LOST = "gpu_lost"
HOST_LOST = "host_lost"

# Lifecycle messages happen a handful of times per run and are the ones a user waits for
# ("did it finish?"), so the rate limiter never holds them back.
LIFECYCLE_RULES = frozenset({RUN_STARTED, RUN_FINISHED, RUN_FAILED, RUN_RESTARTED, RUN_STOPPED})


@dataclass(frozen=True)
class Finding:
    """What a pure rule concluded; the monitor turns it into an `Alert`."""

    rule: str
    severity: str
    message: str
    key: str = ""
    """Tells instances of one rule apart for de-duplication, e.g. "gpu3"."""
    details: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


@dataclass(frozen=True)
class Alert:
    """A finding stamped with where and when it happened."""

    rule: str
    severity: str
    message: str
    run_id: str | None
    """The training run (`run-<sha12>`, clipforge.ids); None where not known (a launch that
    failed before training started)."""
    step: int | None
    time: float
    """Unix time, seconds."""
    host: str
    key: str = ""
    details: Mapping[str, object] = field(default_factory=dict)
    num_suppressed: int = 0
    """Alerts of the same rule and key held back by the rate limiter since the last one sent."""
    launch_id: str | None = None
    """The `fab train` launch (`YYYYMMDD-HHMMSS-commit`); None for a run started without it."""

    @property
    def iso_time(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time))

    def summary(self) -> str:
        """One line for humans: chat messages, the run log, TensorBoard."""
        step = "-" if self.step is None else str(self.step)
        launch = f" (launch {self.launch_id})" if self.launch_id else ""
        where = f"run {self.run_id or '-'}{launch} step {step} on {self.host}"
        # The "clipforge" prefix doubles as the keyword a Feishu bot's keyword filter can require.
        line = f"[clipforge] {self.severity.upper()} {self.rule} ({where}): {self.message}"
        if self.num_suppressed:
            line += f" [{self.num_suppressed} similar alert(s) held back by the rate limit]"
        return line


@dataclass(frozen=True)
class DeliveryOutcome:
    """How sending one alert to one webhook target ended."""

    alert: Alert
    target: str
    """The target's redacted label, never its URL."""
    ok: bool
    attempts: int
    detail: str

    def summary(self) -> str:
        verdict = "delivered" if self.ok else "NOT delivered"
        return (
            f"alert {self.alert.rule} (step {self.alert.step}) {verdict} to {self.target} "
            f"after {self.attempts} attempt(s): {self.detail}"
        )


@dataclass(frozen=True)
class TextEvent:
    """A line for TensorBoard: `SummaryWriter.add_text(event.tag, event.text, event.step)`."""

    tag: str
    text: str
    step: int
