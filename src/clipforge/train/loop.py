"""The training loop: fetch a step's micro-batches, take a contrastive step, log, checkpoint.

The host waits for the device once per optimizer step, at the step's check (`agree`); losses,
gradient norms and timings otherwise stay where they are until a log interval reports them.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from clipforge.alerts.monitor import AlertMonitor
from clipforge.alerts.rules import NonFiniteTrainingError
from clipforge.config import BatchPlan, TrainConfig
from clipforge.train.engine import clamp_logit_scale
from clipforge.train.faults import Faults
from clipforge.train.loss import contrastive_step
from clipforge.train.monitor import PerfMeter
from clipforge.train.validation import validation_due


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived; a checkpoint was saved at `step` and the run can be resumed."""

    def __init__(self, step: int):
        super().__init__(f"stopped on request after step {step}; rerun the stage to resume")
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
    norm = torch.zeros((), device=device) if grad_norm is None else grad_norm
    values = torch.stack(
        [
            loss.detach().float().reshape(()),
            torch.as_tensor(norm, device=device).float().reshape(()),
            torch.tensor(float(stop_requested), device=device),
        ]
    )
    world = dist.get_world_size()
    if world > 1:
        dist.all_reduce(values)
    loss_sum, norm_sum, stops = values.tolist()
    return Agreed(loss_sum / world, None if grad_norm is None else norm_sum / world, stops > 0)


@dataclass
class LoopParts:
    """What the loop needs, built by the stage (engine, data, reporting)."""

    engine: object
    loss_fn: Callable
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    to_device: Callable
    monitor: object | None  # None on ranks other than 0
    alerts: AlertMonitor  # every rank has one; it knows which rules its rank watches
    save: Callable[[int, dict], None]  # save(step, scalars): checkpoint after `step` steps
    validate: Callable[[int], float | None]  # validate(step) -> val loss (None: no val split)
    device: str
    stop: StopFlag
    perf: PerfMeter
    autocast: Callable[[], AbstractContextManager] = nullcontext
    faults: Faults = field(default_factory=Faults)


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
    last: dict = {}
    unchecked: tuple[int, object] | None = (
        None  # (step, grad norm on the device) of the last update
    )
    for step in range(start_step, total_steps):
        done = step + 1  # optimizer steps taken once this one is: the step's number everywhere
        began = time.perf_counter()
        micro_batches = [next(parts.batches) for _ in range(plan.grad_accum_steps)]
        data_wait = time.perf_counter() - began
        micro_batches = parts.faults.apply(
            done, [parts.to_device(b) for b in micro_batches], lambda: parts.stop.requested
        )
        lr = engine.get_lr()[0]  # the rate this step uses; the scheduler advances inside step()
        agreed: list[Agreed] = []

        def skip_if(loss: torch.Tensor, done: int = done, agreed: list = agreed) -> bool:
            nonlocal unchecked
            previous = unchecked
            agreed.append(agree(loss, previous and previous[1], parts.stop.requested, parts.device))
            if previous:
                _check_update(alerts, previous[0], agreed[0].previous_grad_norm)
                unchecked = None
            verdict = alerts.check_loss(done, agreed[0].loss)
            if verdict.stop:
                raise NonFiniteTrainingError(verdict.message)
            return verdict.skip

        out = contrastive_step(engine, parts.loss_fn, micro_batches, skip_if, parts.autocast)
        if not out.skipped:
            clamp_logit_scale(engine, train.max_logit_scale)
            unchecked = (done, engine.get_global_grad_norm())
        parts.perf.step_done(data_wait)
        logged = done % train.log_every_steps == 0 or done == total_steps
        saved = done % train.save_every_steps == 0 or done == total_steps
        stopping = done < total_steps and agreed[0].stop
        last = {"step": done, "epoch": done / steps_per_epoch, "loss": agreed[0].loss, "lr": lr}
        if logged or saved or stopping:  # read back only what is reported
            last["grad_norm"] = _host_grad_norm(unchecked[1]) if unchecked else None
            last["logit_scale"] = float(out.logit_scale)
        if done == total_steps and unchecked:  # the last update has no next step to check it
            _check_update(alerts, done, last["grad_norm"])
        if logged:
            last.update(parts.perf.interval())
            if parts.monitor:
                parts.monitor.step(done, last)
                parts.monitor.texts(alerts.drain_events())
        if validation_due(done, steps_per_epoch, total_steps, train.val_every_steps):
            last["val_loss"] = parts.validate(done)
            alerts.heartbeat(done)
        if saved or stopping:
            parts.save(done, last)
            alerts.heartbeat(done)
        if stopping:
            raise StopRequested(done)
    return last


def _host_grad_norm(norm) -> float | None:
    return None if norm is None else float(norm)


def _check_update(alerts: AlertMonitor, step: int, grad_norm: float | None) -> None:
    verdict = alerts.check_update(step, grad_norm)
    if verdict.stop:
        raise NonFiniteTrainingError(verdict.message)
