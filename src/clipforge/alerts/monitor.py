"""AlertMonitor: the one object the training loop talks to.

It runs the rules, stamps findings into alerts, and sends each one three ways: the run log
(python logging), TensorBoard text (`drain_events`), and webhooks (rate-limited, on background
threads). Each fact is watched once, where it is known: rank 0 watches the loss, the run's
lifecycle and stalls; each node's local rank 0 watches that node's GPUs (NVML sees only the
local ones, and one watcher per node sends one alert per GPU, not one per rank). Every rank may
call `check_loss` / `check_update` and gets the same verdict for the same (globally reduced)
numbers; only rank 0 alerts on them.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from clipforge.alerts import events
from clipforge.alerts.config import AlertsConfig
from clipforge.alerts.delivery import WebhookDispatcher
from clipforge.alerts.events import Alert, DeliveryOutcome, Finding, TextEvent
from clipforge.alerts.gpu import GpuHealthRules, GpuPoller, GpuReader, open_nvml
from clipforge.alerts.health import HealthReading, HealthRules
from clipforge.alerts.ratelimit import AlertGate
from clipforge.alerts.rules import StepRules, StepVerdict
from clipforge.alerts.targets import WebhookTarget, load_targets, redact
from clipforge.alerts.watchdog import StallWatchdog
from clipforge.progress import ProgressFile

_LOG_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.ERROR}
# TensorBoard text is for reading, not archiving: keep the latest if the loop never drains.
_MAX_PENDING_EVENTS = 1000
_MAX_MESSAGE_CHARS = 1500


class AlertMonitor:
    def __init__(
        self,
        config: AlertsConfig,
        run_id: str,
        *,
        targets: Sequence[WebhookTarget] = (),
        rank: int = 0,
        local_rank: int = 0,
        log: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        open_gpu_reader: Callable[[], GpuReader | str] = open_nvml,
        launch_id: str | None = None,
        progress: ProgressFile | None = None,
    ) -> None:
        self.config = config
        self.run_id = run_id
        self.launch_id = launch_id
        self.watches_run = rank == 0
        self.watches_gpus = local_rank == 0
        self._targets = tuple(targets)
        self._log = log if log is not None else logging.getLogger("clipforge.alerts")
        self._clock, self._wall_clock = clock, wall_clock
        self._open_gpu_reader = open_gpu_reader
        self._host = socket.gethostname()
        self._lock = threading.Lock()
        self._events: deque[TextEvent] = deque(maxlen=_MAX_PENDING_EVENTS)
        self._last_step: int | None = None
        self._run_reported = False
        self._started = self._closed = False
        self._rules = StepRules(config)
        self._health = HealthRules(config)
        self._gate = AlertGate(
            min_seconds_between_repeats=config.min_seconds_between_repeats,
            max_messages_per_window=config.max_messages_per_window,
            window_seconds=config.rate_window_seconds,
        )
        self._dispatcher = (
            WebhookDispatcher(self._targets, config, log=self._log, on_outcome=self._record_outcome)
            if self._targets
            else None
        )
        self._watchdog = (
            StallWatchdog(
                config.stall_timeout_seconds,
                on_stall=self._stalled,
                on_recover=self._recovered,
                log=self._log,
                clock=clock,
            )
            if self.watches_run
            else None
        )
        self._poller: GpuPoller | None = None
        # Every rank's heartbeat for the supervisor's hang watchdog (None: not supervised).
        self._progress = progress

    @classmethod
    def from_environment(
        cls, config: AlertsConfig, run_id: str, *, rank: int = 0, local_rank: int = 0, **kwargs
    ) -> AlertMonitor:
        """Targets from CLIPFORGE_ALERT_WEBHOOKS / _FILE, read only by processes that alert;
        a progress file for the supervisor's watchdog when it set CLIPFORGE_PROGRESS_DIR."""
        targets = load_targets() if rank == 0 or local_rank == 0 else []
        kwargs.setdefault(
            "progress", ProgressFile.from_environment(rank, config.stall_timeout_seconds)
        )
        return cls(config, run_id, targets=targets, rank=rank, local_rank=local_rank, **kwargs)

    def __repr__(self) -> str:
        labels = ", ".join(t.label for t in self._targets) or "none"
        return (
            f"AlertMonitor(run_id={self.run_id!r}, launch_id={self.launch_id!r}, "
            f"targets=[{labels}])"
        )

    # -- lifecycle of the monitor ------------------------------------------------------------

    def start(self) -> AlertMonitor:
        """Start the delivery threads, the stall watchdog and (local rank 0) the GPU poller."""
        if self._started:
            return self
        self._started = True
        if self._progress:  # set-up is over: from now on, silence is a hang
            self._progress.beat(self._last_step)
        if self._dispatcher:
            self._dispatcher.start()
        if self._watchdog:
            self._watchdog.start()
        if self.watches_gpus:
            self._start_gpu_poller()
        return self

    def close(self) -> None:
        """Stop the threads; wait up to alerts.flush_timeout_seconds for queued messages."""
        if self._closed:
            return
        self._closed = True
        if self._progress:
            self._progress.close(self._last_step)
        if self._watchdog:
            self._watchdog.stop()
        if self._poller:
            self._poller.stop()
        if self._dispatcher and self._started:
            self._dispatcher.close(self.config.flush_timeout_seconds)

    def __enter__(self) -> AlertMonitor:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # A loop that forgot run_failed still reports the crash; Ctrl-C is no failure to page.
        if exc is not None and not self._run_reported and not isinstance(exc, KeyboardInterrupt):
            self.run_failed(exc)
        self.close()

    # -- what the training loop calls --------------------------------------------------------

    def run_started(self, info: Mapping[str, object] | None = None) -> None:
        text = ", ".join(f"{k}={v}" for k, v in (info or {}).items())
        self._run_event(
            events.RUN_STARTED, "info", f"run started{': ' + text if text else ''}", info
        )

    def run_finished(self, metrics: Mapping[str, object] | None = None) -> None:
        self._run_reported = True
        text = ", ".join(f"{k}={_short(v)}" for k, v in (metrics or {}).items())
        self._run_event(
            events.RUN_FINISHED, "info", f"run finished{': ' + text if text else ''}", metrics
        )

    def run_failed(self, error: BaseException | str) -> None:
        self._run_reported = True
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._run_event(events.RUN_FAILED, "critical", f"run failed: {text}", None)

    def run_stopped(self, step: int) -> None:
        """Stopped on request (e.g. `fab stop`) with a checkpoint saved: not a failure."""
        self._run_reported = True
        self._run_event(
            events.RUN_STOPPED,
            "info",
            f"run stopped on request after step {step}; rerunning the train stage "
            f"resumes from its checkpoint",
            {"step": step},
        )

    def run_restarted(self, num_restarts: int, *, from_step: int | None = None) -> None:
        where = "from scratch" if from_step is None else f"from the checkpoint of step {from_step}"
        self._run_event(
            events.RUN_RESTARTED,
            "warning",
            f"run restarted {where} (restart {num_restarts})",
            {"num_restarts": num_restarts, "from_step": from_step},
        )

    def disk_space_low(self, path: str, free_bytes: int, checkpoint_bytes: int) -> None:
        """Before a checkpoint save that will leave less room than another one needs."""
        self._run_event(
            events.DISK_SPACE_LOW,
            "warning",
            f"disk almost full at {path}: {free_bytes:,} bytes free, a checkpoint needs "
            f"~{checkpoint_bytes:,}; after this one the next save may not fit. Free space there "
            f"before the run stops on it",
            {"path": path, "free_bytes": free_bytes, "checkpoint_bytes": checkpoint_bytes},
        )

    def checkpoint_damaged(self, message: str) -> None:
        """A checkpoint found damaged at start (set aside; an older one is tried)."""
        self._run_event(events.CHECKPOINT_DAMAGED, "warning", message, None)

    def store_unreachable(self, store: str, failures: int, error: str, waiting: int) -> None:
        """Uploads to the run store failed `failures` times in a row; training goes on."""
        self._run_event(
            events.STORE_UNREACHABLE,
            "warning",
            f"run store {store}: {failures} upload attempt(s) in a row failed ({error}); training "
            f"goes on, {waiting} checkpoint(s) wait on this disk (none is pruned before it is "
            f"uploaded), and the uploads resume when the store answers",
            {"store": store, "failures": failures, "error": error, "waiting": waiting},
        )

    def store_sync_lag(
        self, store: str, lag_seconds: float, lag_steps: int, max_lag_seconds: float
    ) -> None:
        """The oldest checkpoint not yet in the run store has waited longer than allowed."""
        self._run_event(
            events.STORE_SYNC_LAG,
            "warning",
            f"run store {store} is {lag_steps} steps behind: a checkpoint has waited "
            f"{lag_seconds:.0f} s for its upload (storage.max_lag_seconds="
            f"{max_lag_seconds:g}); losing this host now would lose those steps",
            {"store": store, "lag_seconds": lag_seconds, "lag_steps": lag_steps},
        )

    def store_caught_up(self, store: str, tag: str) -> None:
        self._run_event(
            events.STORE_CAUGHT_UP,
            "info",
            f"run store {store} holds every checkpoint again, up to {tag}",
            {"store": store, "tag": tag},
        )

    def check_loss(self, step: int, loss: float) -> StepVerdict:
        """After the forward pass, before backward: the globally reduced loss of `step`."""
        verdict = self._rules.check_loss(step, float(loss))
        self._step_seen(step, verdict)
        return verdict

    def check_update(self, step: int, grad_norm: float | None) -> StepVerdict:
        """After the optimizer step: its global gradient norm (None if not computed)."""
        verdict = self._rules.check_update(step, None if grad_norm is None else float(grad_norm))
        self._step_seen(step, verdict)
        return verdict

    def check_health(self, reading: HealthReading) -> None:
        """At a log interval: logit scale and in-batch accuracy, already read from the device.
        Only rank 0 alerts (every rank sees the same logit scale; rank 0's batch stands for
        the others)."""
        if self.watches_run:
            for finding in self._health.observe(reading):
                self._emit(finding, reading.step)

    def check_validation(self, step: int, mean_recall: float | None) -> None:
        """After a validation: its mean recall (the same on every rank)."""
        if self.watches_run:
            for finding in self._health.observe_validation(step, mean_recall):
                self._emit(finding, step)

    def heartbeat(self, step: int) -> None:
        """Progress without a training step (eval, checkpoint save): keeps the watchdog quiet."""
        self._last_step = step
        if self._watchdog:
            self._watchdog.beat(step)
        if self._progress:
            self._progress.beat(step)

    def drain_events(self) -> list[TextEvent]:
        """Alerts and delivery outcomes since the last call, for SummaryWriter.add_text."""
        with self._lock:
            drained = list(self._events)
            self._events.clear()
        return drained

    # -- internals ---------------------------------------------------------------------------

    def _step_seen(self, step: int, verdict: StepVerdict) -> None:
        self.heartbeat(step)
        if self.watches_run:
            for finding in verdict.findings:
                self._emit(finding, step)

    def _run_event(self, rule: str, severity: str, message: str, details: Mapping | None) -> None:
        if self.watches_run:
            self._emit(
                Finding(rule, severity, message, details=dict(details or {})), self._last_step
            )

    def _start_gpu_poller(self) -> None:
        reader = self._open_gpu_reader()
        if isinstance(reader, str):
            self._emit(
                Finding(
                    events.GPU_MONITOR_UNAVAILABLE,
                    "info",
                    f"GPU temperature/throttle/ECC monitoring is off on this node: {reader}",
                ),
                self._last_step,
            )
            return
        self._poller = GpuPoller(
            reader,
            GpuHealthRules(temp_celsius=self.config.gpu_temp_celsius),
            poll_seconds=self.config.gpu_poll_seconds,
            log=self._log,
            on_findings=self._emit_gpu_findings,
        )
        self._poller.start()

    def _emit_gpu_findings(self, findings: list[Finding]) -> None:
        for finding in findings:
            self._emit(finding, self._last_step)

    def _stalled(self, last_step: int | None, idle_seconds: float) -> None:
        self._emit(
            Finding(
                events.STALL,
                "critical",
                f"no training step completed for {idle_seconds:.0f} s "
                f"(alerts.stall_timeout_seconds={self.config.stall_timeout_seconds:g}); last step "
                f"{'none yet' if last_step is None else last_step}. A collective may hang or a GPU "
                f"may be dead: check nvidia-smi and the logs of every node",
            ),
            last_step,
        )

    def _recovered(self, step: int, stalled_seconds: float) -> None:
        self._emit(
            Finding(
                events.STALL_RECOVERED,
                "info",
                f"training progresses again at step {step} after {stalled_seconds:.0f} s "
                f"without progress",
            ),
            step,
        )

    def _emit(self, finding: Finding, step: int | None) -> None:
        # Alerting must never be what crashes a training run: a bug here is logged, not raised.
        try:
            self._emit_unguarded(finding, step)
        except Exception:
            self._log.exception("alerts: could not emit %s alert", finding.rule)

    def _emit_unguarded(self, finding: Finding, step: int | None) -> None:
        # Texts can come from outside (exception messages, run info): strip any webhook URL.
        details = {
            key: redact(value, self._targets) if isinstance(value, str) else value
            for key, value in finding.details.items()
        }
        alert = Alert(
            rule=finding.rule,
            severity=finding.severity,
            message=redact(finding.message, self._targets)[:_MAX_MESSAGE_CHARS],
            run_id=self.run_id,
            launch_id=self.launch_id,
            step=step,
            time=self._wall_clock(),
            host=self._host,
            key=finding.key,
            details=details,
        )
        with self._lock:
            admission = self._gate.admit(
                alert.rule, alert.key, self._clock(), exempt=alert.rule in events.LIFECYCLE_RULES
            )
        if self._dispatcher is None:
            delivery = "no webhook configured"
        elif admission.send:
            alert = replace(alert, num_suppressed=admission.num_suppressed_before)
            self._dispatcher.submit(alert)
            delivery = f"queued for {len(self._targets)} target(s)"
        else:
            delivery = f"held back ({admission.num_suppressed_before} so far): {admission.reason}"
        self._log.log(_LOG_LEVELS[alert.severity], "%s [webhook: %s]", alert.summary(), delivery)
        self._record(
            TextEvent(
                f"alerts/{alert.rule}", f"{alert.summary()}\n\nwebhook: {delivery}", step or 0
            )
        )

    def _record_outcome(self, outcome: DeliveryOutcome) -> None:
        self._record(TextEvent("alerts/delivery", outcome.summary(), outcome.alert.step or 0))

    def _record(self, event: TextEvent) -> None:
        with self._lock:
            self._events.append(event)


def _short(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
