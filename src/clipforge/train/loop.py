"""The training loop: fetch a step's micro-batches, take a contrastive step, log, checkpoint."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from clipforge.alerts.monitor import AlertMonitor
from clipforge.alerts.rules import NonFiniteTrainingError
from clipforge.config import BatchPlan, TrainConfig
from clipforge.train.faults import Faults
from clipforge.train.loss import contrastive_step
from clipforge.train.validation import validation_due


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived; a checkpoint was saved at `step` and the run can be resumed."""

    def __init__(self, step: int):
        super().__init__(f"stopped on request after step {step}; rerun the stage to resume")
        self.step = step


@dataclass
class StopFlag:
    """Set by a signal handler; checked (and agreed across ranks) at step boundaries."""

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

    def agreed(self, device: str) -> bool:
        """True on every rank when any rank was asked to stop (all must checkpoint together)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


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
    for step in range(start_step, total_steps):
        done = step + 1  # optimizer steps taken once this one is: the step's number everywhere
        began = time.perf_counter()
        micro_batches = [next(parts.batches) for _ in range(plan.grad_accum_steps)]
        data_wait = time.perf_counter() - began
        micro_batches = parts.faults.apply(
            done, [parts.to_device(b) for b in micro_batches], lambda: parts.stop.requested
        )
        lr = engine.get_lr()[0]  # the rate this step uses; the scheduler advances inside step()

        reduced: dict[str, float] = {}

        def skip_if(loss: float, done: int = done, reduced: dict = reduced) -> bool:
            reduced["loss"] = _mean_over_ranks(loss, parts.device)
            verdict = alerts.check_loss(done, reduced["loss"])
            if verdict.stop:
                raise NonFiniteTrainingError(verdict.message)
            return verdict.skip

        out = contrastive_step(engine, parts.loss_fn, micro_batches, train.max_logit_scale, skip_if)
        grad_norm = None if out.skipped else _grad_norm(engine)
        if not out.skipped:
            verdict = alerts.check_update(done, grad_norm)
            if verdict.stop:
                raise NonFiniteTrainingError(verdict.message)
        elapsed = time.perf_counter() - began
        last = {
            "step": done,
            "epoch": done / steps_per_epoch,
            "loss": reduced["loss"],
            "grad_norm": grad_norm,
            "lr": lr,
            "logit_scale": out.logit_scale,
            "samples_per_s": plan.global_batch_size / elapsed,
            "step_s": elapsed,
            "data_wait_s": data_wait,
        }
        if parts.monitor and (done % train.log_every_steps == 0 or done == total_steps):
            parts.monitor.step(done, last)
            parts.monitor.texts(alerts.drain_events())
        if validation_due(done, steps_per_epoch, total_steps, train.val_every_steps):
            last["val_loss"] = parts.validate(done)
            alerts.heartbeat(done)
        saved = done % train.save_every_steps == 0 or done == total_steps
        if saved:
            parts.save(done, last)
            alerts.heartbeat(done)
        if done < total_steps and parts.stop.agreed(parts.device):
            if not saved:
                parts.save(done, last)
            raise StopRequested(done)
    return last


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def _mean_over_ranks(value: float, device: str) -> float:
    """Each rank's loss covers its own rows of the global batch; report their mean."""
    if dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()
