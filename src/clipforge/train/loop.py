"""The training loop: fetch a step's micro-batches, take a contrastive step, log, checkpoint.

The host waits for the device once per optimizer step, at the step's check (`agree`); losses,
gradient norms and timings otherwise stay where they are until a log interval reports them.
"""

from __future__ import annotations

import functools
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from clipforge.alerts.monitor import AlertMonitor
from clipforge.alerts.rules import NonFiniteTrainingError
from clipforge.train.config import BatchPlan, TrainConfig
from clipforge.train.engine import clamp_logit_scale
from clipforge.train.faults import Faults
from clipforge.train.health import FeatureTap, health_reading
from clipforge.train.loss import contrastive_step
from clipforge.train.reporting import PerfMeter
from clipforge.train.validation import validation_due


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived; a checkpoint was saved at `step` and the run can be resumed (or,
    stopped during set-up with `during` saying where, nothing was trained: step 0)."""

    def __init__(self, step: int, during: str | None = None):
        where = f"during {during}" if during else f"after step {step}"
        super().__init__(f"stopped on request {where}; rerun the stage to resume")
        self.step = step


@dataclass
class StopFlag:
    """Set by a signal handler; agreed across ranks at each step's check (see `StepCheck`)."""

    requested: bool = False
    _previous: dict = field(default_factory=dict)

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.requested = True


@dataclass(frozen=True)
class Agreed:
    """What every rank learns at a step's check, identically."""

    loss: float  # the step's full-batch loss, mean over ranks
    previous_grad_norm: float | None  # the global gradient norm of the previous update
    stop: bool  # some rank was asked to stop


def agree(loss: torch.Tensor, grad_norm, stop_requested: bool, device: str) -> Agreed:
    """The step's one host synchronisation: one all-reduce and one read of three numbers.

    A non-finite loss must be known before backward so the step can be skipped whole, on every
    rank at once; that read is unavoidable. The previous step's gradient norm (long computed by
    now) and the stop flag ride along, so they cost no collective or wait of their own."""
    norm = 0.0 if grad_norm is None else grad_norm  # (`or` would read a tensor back)
    values = torch.stack([_on_device(v, device) for v in (loss, norm, float(stop_requested))])
    world = dist.get_world_size()
    if world > 1:
        dist.all_reduce(values)
    loss_sum, norm_sum, stops = values.tolist()
    return Agreed(loss_sum / world, None if grad_norm is None else norm_sum / world, stops > 0)


def stop_agreed(stop: StopFlag, device: str) -> bool:
    """Whether some rank was asked to stop: one all-reduce of the flag, at a point of the set-up
    every rank passes in the same order."""
    flag = _on_device(float(stop.requested), device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag)
    return flag.item() > 0


def _on_device(value, device: str) -> torch.Tensor:
    """A 0-dim fp32 tensor on the device: filled there, never copied from the host (a copy to
    the GPU from pageable memory would wait for the work queued before it)."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().reshape(())
    return torch.full((), float(value), device=device)


@dataclass
class LoopParts:
    """What the loop needs, built by the stage (engine, data, reporting)."""

    engine: object
    loss_fn: Callable
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    to_device: Callable
    report: object | None  # TensorBoard and the metrics TSVs (train.reporting); None off rank 0
    alerts: AlertMonitor  # every rank has one; it knows which rules its rank watches
    save: Callable[[int, dict], None]  # save(step, scalars): checkpoint after `step` steps
    validate: Callable[[int], float | None]  # validate(step) -> val loss (None: no val split)
    device: str
    stop: StopFlag
    perf: PerfMeter
    autocast: Callable[[], AbstractContextManager] = nullcontext
    faults: Faults = field(default_factory=Faults)
    teacher: Callable | None = None  # train.distill_model's frozen model (clipforge.train.teacher)


class StepChecks:
    """The alert rules at their points in a step, fed by the step's one synchronisation.

    Before backward: the previous update's gradient norm (computed on the device since) and this
    step's loss, both agreed across ranks by `agree`. So every rank reaches the same skip or stop
    verdict, and a gradient norm is checked one step late, never at the cost of a wait."""

    def __init__(self, alerts: AlertMonitor, stop: StopFlag, device: str):
        self.alerts = alerts
        self.stop = stop
        self.device = device
        self.agreed: Agreed | None = None  # this step's
        self.pending: tuple[int, object] | None = None  # (step, grad norm on the device)

    def before_backward(self, step: int, loss: torch.Tensor) -> bool:
        """True: the loss is not finite, skip the step (the alert rules count it)."""
        previous, self.pending = self.pending, None
        norm = previous[1] if previous else None
        self.agreed = agree(loss, norm, self.stop.requested, self.device)
        if previous:
            self._check_update(previous[0], self.agreed.previous_grad_norm)
        verdict = self.alerts.check_loss(step, self.agreed.loss)
        if verdict.stop:
            raise NonFiniteTrainingError(verdict.message)
        return verdict.skip

    def updated(self, step: int, grad_norm) -> None:
        self.pending = (step, grad_norm)

    def pending_grad_norm(self) -> float | None:
        """The last update's gradient norm, read from the device (None: no update this step)."""
        norm = self.pending[1] if self.pending else None
        return None if norm is None else float(norm)

    def finish(self) -> None:
        """The last update of the run has no next step to check it."""
        if self.pending:
            self._check_update(self.pending[0], self.pending_grad_norm())
            self.pending = None

    def _check_update(self, step: int, grad_norm: float | None) -> None:
        verdict = self.alerts.check_update(step, grad_norm)
        if verdict.stop:
            raise NonFiniteTrainingError(verdict.message)


def train_clip(
    parts: LoopParts,
    train: TrainConfig,
    plan: BatchPlan,
    start_step: int,
    total_steps: int,
    steps_per_epoch: int,
) -> dict:
    """Run optimizer steps start_step..total_steps-1; returns the final scalars."""
    engine, alerts = parts.engine, parts.alerts
    checks = StepChecks(alerts, parts.stop, parts.device)
    loss_fn = FeatureTap(parts.loss_fn)  # keeps the step's features for the health alerts
    last: dict = {}
    for step in range(start_step, total_steps):
        done = step + 1  # optimizer steps taken once this one is: the step's number everywhere
        began = time.perf_counter()
        micro_batches = [next(parts.batches) for _ in range(plan.grad_accum_steps)]
        data_wait = time.perf_counter() - began
        micro_batches = parts.faults.apply(
            done, [parts.to_device(b) for b in micro_batches], lambda: parts.stop.requested
        )
        lr = engine.get_lr()[0]  # the rate this step uses; the scheduler advances inside step()
        skip_if = functools.partial(checks.before_backward, done)
        out = contrastive_step(
            engine, loss_fn, micro_batches, skip_if, parts.autocast, parts.teacher
        )
        if not out.skipped:
            clamp_logit_scale(engine, train.max_logit_scale)
            checks.updated(done, engine.get_global_grad_norm())
        parts.perf.step_done(time.perf_counter() - began, data_wait)
        logged = done % train.log_every_steps == 0 or done == total_steps
        saved = done % train.save_every_steps == 0 or done == total_steps
        stopping = done < total_steps and checks.agreed.stop
        last = {"step": done, "epoch": done / steps_per_epoch, "loss": checks.agreed.loss, "lr": lr}
        if logged or saved or stopping:  # read back from the device only what is reported
            last["grad_norm"] = checks.pending_grad_norm()
            health = health_reading(done, loss_fn, out.logit_scale, train.max_logit_scale)
            last["logit_scale"] = health.logit_scale
            if out.logit_bias is not None:  # train.loss: siglip
                last["logit_bias"] = out.logit_bias.item()
            if logged:
                alerts.check_health(health)
        if done == total_steps:
            checks.finish()
        if logged:
            last.update(parts.perf.interval())
            if parts.report:
                parts.report.step(done, last)
                parts.report.texts(alerts.drain_events())
        if validation_due(done, steps_per_epoch, total_steps, train.val_every_steps):
            last["val_loss"] = parts.validate(done)
            alerts.heartbeat(done)
        if saved or stopping:
            parts.save(done, last)
            alerts.heartbeat(done)
        if stopping:
            raise StopRequested(done)
    return last
