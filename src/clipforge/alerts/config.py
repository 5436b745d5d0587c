"""The `alerts:` section of params.yaml: thresholds and delivery limits.

Webhook URLs are deliberately *not* here: they are credentials and come from the environment
(see `targets.py`), so that params.yaml, which is committed and saved next to every output,
never holds one. After `max_consecutive_nonfinite` non-finite steps the run stops with a clear
error; there is no in-process rollback (see docs/alerts.md, "Why stop and not roll back").
"""

from __future__ import annotations

from dataclasses import dataclass

from clipforge.fields import Section, knob


@dataclass(frozen=True, kw_only=True)
class AlertsConfig(Section):
    SECTION = "alerts"

    loss_spike_factor: float = knob(
        3.0, "Alert when a step's loss exceeds this many times its moving average.", gt=1.0
    )
    loss_ema_beta: float = knob(
        0.98,
        "Smoothing of the loss moving average (exponential; ~1/(1-beta) steps).",
        gt=0.0,
        lt=1.0,
    )
    loss_spike_warmup_steps: int = knob(
        100,
        "Finite losses this process must see before the spike rule is armed (a resumed "
        "run warms up again).",
        ge=1,
    )
    max_consecutive_nonfinite: int = knob(
        5,
        "Non-finite steps (loss or gradient norm) in a row after which the run stops; a "
        "non-finite loss skips its step.",
        ge=1,
    )
    temperature_alerts: bool = knob(
        True,
        "Alert when the learned logit scale (inverse temperature) sits at train.max_logit_scale "
        "or falls to logit_scale_floor (alerts/health.py).",
    )
    logit_scale_pinned_fraction: float = knob(
        0.99,
        "The logit scale counts as pinned at or above this fraction of its cap.",
        gt=0.0,
        le=1.0,
    )
    logit_scale_floor: float = knob(
        2.0, "The logit scale counts as collapsed at or below this (CLIP starts at 14.3).", gt=0.0
    )
    chance_accuracy_alerts: bool = knob(
        True,
        "Alert when in-batch contrastive accuracy stays below chance_accuracy_factor / batch "
        "after chance_accuracy_warmup_steps.",
    )
    chance_accuracy_factor: float = knob(
        2.0, "Accuracy below this many times chance (1/batch) counts as near chance.", gt=1.0
    )
    chance_accuracy_warmup_steps: int = knob(
        500, "Optimizer steps before the chance-accuracy rule is armed.", ge=0
    )
    health_patience_logs: int = knob(
        3,
        "Log intervals in a row the temperature or accuracy condition must hold before it alerts.",
        ge=1,
    )
    recall_decline_alerts: bool = knob(
        True, "Alert when validation mean recall falls recall_decline_validations times in a row."
    )
    recall_decline_validations: int = knob(
        3, "Validations in a row, each with a lower mean recall than the one before.", ge=1
    )
    gpu_temp_celsius: float = knob(
        85.0, "Alert when a GPU's core temperature reaches this.", ge=40.0, le=120.0
    )
    gpu_poll_seconds: float = knob(
        30.0, "Seconds between two NVML readings of the node's GPUs.", gt=0.0, le=3600.0
    )
    stall_timeout_seconds: float = knob(
        900.0,
        "Alert when no step completed for this long (a hung collective or a dead GPU); "
        "also how long a collective waits for a peer before it fails (a restart follows). "
        "Must exceed the longest step, checkpoint save, validation or export.",
        gt=0.0,
    )
    setup_timeout_seconds: float | None = knob(
        None,
        "Under the launcher's supervisor, each part of a rank's set-up (joining the process "
        "group, building the model and the engine, loading the checkpoint) silent for this long "
        "is a hang: stacks dumped, an alert, a restart. None: stall_timeout_seconds.",
        gt=0.0,
    )
    min_seconds_between_repeats: float = knob(
        600.0,
        "An alert of the same rule (and GPU) within this many seconds of the last one "
        "sent is only counted and mentioned in the next one.",
        ge=0.0,
    )
    max_messages_per_window: int = knob(
        30,
        "At most this many webhook messages per rate_window_seconds, all rules together "
        "(run started/finished/failed/restarted are never held back).",
        ge=1,
    )
    rate_window_seconds: float = knob(3600.0, "The window of max_messages_per_window.", gt=0.0)
    max_retries: int = knob(
        3,
        "Further attempts after a failed delivery (network error, timeout, HTTP 429 or 5xx).",
        ge=0,
    )
    retry_backoff_seconds: float = knob(
        2.0, "Wait before the first retry; doubled for each next one.", ge=0.0
    )
    http_timeout_seconds: float = knob(10.0, "Timeout of one webhook request.", gt=0.0)
    queue_size: int = knob(
        100,
        "Messages waiting per webhook target; when full, the oldest is dropped (and counted).",
        ge=1,
    )
    flush_timeout_seconds: float = knob(
        30.0,
        "How long the end of a run waits for queued "
        "messages (e.g. `run finished`) to be delivered.",
        ge=0.0,
    )

    @property
    def setup_budget_seconds(self) -> float:
        """The set-up budget in force: setup_timeout_seconds, or the stall timeout."""
        return self.setup_timeout_seconds or self.stall_timeout_seconds
