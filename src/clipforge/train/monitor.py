"""What a run reports while it trains: TensorBoard events, a TSV for `dvc plots`, progress.

Only rank 0 writes. On resume, TensorBoard is told to purge events after the checkpoint's step
and the TSV keeps only rows up to it, so curves have no doubled segments.
"""

from __future__ import annotations

import csv
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("clipforge.train")

COLUMNS = (
    "step",
    "epoch",
    "loss",
    "grad_norm",
    "lr",
    "logit_scale",
    "samples_per_s",
    "step_s",
    "data_wait_s",
    "data_wait_share",
    "mfu",
    "peak_mem_gb",
)
_TB_NAMES = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "logit_scale": "train/logit_scale",
    "samples_per_s": "perf/samples_per_s",
    "step_s": "perf/step_s",
    "data_wait_s": "perf/data_wait_s",
    "data_wait_share": "perf/data_wait_share",
    "mfu": "perf/mfu",
    "peak_mem_gb": "perf/peak_mem_gb",
}


@dataclass
class _Totals:
    steps: int = 0
    seconds: float = 0.0  # from fetching a step's data to its update queued, summed
    data_wait_seconds: float = 0.0


class PerfMeter:
    """Throughput per log interval and over the whole run, from the host clock.

    The loop waits for the device once per step (train/loop.py), so a step's wall time is its
    device time too; validation and checkpoint time between steps are left out. samples/s counts
    global samples; MFU is per clipforge.train.flops; data-wait share is the part of the step
    time spent waiting for the loader; peak memory is this rank's (GPU: the allocator's peak;
    CPU: the process's peak RSS).
    """

    def __init__(
        self,
        samples_per_step: int,
        flops_per_sample: float | None,
        peak_flops_per_rank: float | None,
        world_size: int,
        device: str,
    ):
        self.samples_per_step = samples_per_step
        self.flops_per_sample = flops_per_sample
        self.peak_flops_per_rank = peak_flops_per_rank
        self.world_size = world_size
        self.device = device
        self._interval = _Totals()
        self._run = _Totals()

    def step_done(self, seconds: float, data_wait_seconds: float) -> None:
        for totals in (self._interval, self._run):
            totals.steps += 1
            totals.seconds += seconds
            totals.data_wait_seconds += data_wait_seconds

    def interval(self) -> dict[str, float | None]:
        """The figures since the previous call (or the start)."""
        figures = self._figures(self._interval)
        self._interval = _Totals()
        return figures

    def run(self) -> dict[str, float | None]:
        """The figures of every step this process took: the end-of-run summary's."""
        return self._figures(self._run)

    def _figures(self, totals: _Totals) -> dict[str, float | None]:
        from clipforge.train.flops import mfu

        seconds, steps = max(totals.seconds, 1e-9), max(totals.steps, 1)
        samples_per_s = totals.steps * self.samples_per_step / seconds
        return {
            "samples_per_s": samples_per_s,
            "step_s": seconds / steps,
            "data_wait_s": totals.data_wait_seconds / steps,
            "data_wait_share": totals.data_wait_seconds / seconds,
            "mfu": mfu(
                samples_per_s, self.flops_per_sample, self.peak_flops_per_rank, self.world_size
            ),
            "peak_mem_gb": peak_memory_gb(self.device),
        }


def peak_memory_gb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


class TrainMonitor:
    def __init__(
        self,
        log_dir: Path,
        metrics_file: Path,
        start_step: int,
        total_steps: int,
        interactive: bool | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)
        self.metrics_file = metrics_file
        self._rows = _kept_rows(metrics_file, start_step)
        self._write_rows()
        self.start_step = start_step
        self.total_steps = total_steps
        self.started = time.monotonic()
        interactive = sys.stderr.isatty() if interactive is None else interactive
        self.bar = None
        if interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def step(self, step: int, scalars: dict[str, float]) -> None:
        """Record the scalars of optimizer step `step` (1-based: steps done so far)."""
        for name, value in scalars.items():
            if name in _TB_NAMES and value is not None:
                self.writer.add_scalar(_TB_NAMES[name], value, step)
        self._rows.append(
            {c: _or_blank(scalars.get(c, step if c == "step" else "")) for c in COLUMNS}
        )
        self._write_rows()
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{scalars['loss']:.3f}", lr=f"{scalars['lr']:.2e}")
        else:
            log.info(
                "step %d/%d (%.0f%%) loss %.4f lr %.2e %.1f samples/s MFU %s data wait %.0f%% "
                "peak mem %.1f GB ETA %s",
                step,
                self.total_steps,
                100 * step / self.total_steps,
                scalars["loss"],
                scalars["lr"],
                scalars["samples_per_s"],
                _percent(scalars.get("mfu")),
                100 * scalars["data_wait_share"],
                scalars["peak_mem_gb"],
                self.eta(step),
            )

    def texts(self, events) -> None:
        """Alerts and webhook outcomes as TensorBoard text (events: clipforge.alerts.events.TextEvent)."""
        for event in events:
            self.writer.add_text(event.tag, event.text, event.step)

    def scalar(self, name: str, value: float, step: int) -> None:
        self.writer.add_scalar(name, value, step)
        log.info("step %d: %s %.4f", step, name, value)

    def eta(self, step: int) -> str:
        done = step - self.start_step
        if done <= 0:
            return "?"
        remaining = (time.monotonic() - self.started) / done * (self.total_steps - step)
        minutes, seconds = divmod(int(remaining), 60)
        return f"{minutes}m{seconds:02d}s"

    def close(self) -> None:
        self.writer.close()
        if self.bar is not None:
            self.bar.close()

    def _write_rows(self) -> None:
        # Rewritten whole at each log step: small (one row per log interval), and never torn.
        from clipforge.fsutil import atomic_write_text

        lines = ["\t".join(COLUMNS)]
        lines += ["\t".join(_fmt(row[c]) for c in COLUMNS) for row in self._rows]
        atomic_write_text(self.metrics_file, "\n".join(lines) + "\n")


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _or_blank(value):
    return "" if value is None else value


def _fmt(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _kept_rows(path: Path, start_step: int) -> list[dict]:
    if not start_step or not path.is_file():
        return []
    with open(path, encoding="utf-8", newline="") as f:
        return [row for row in csv.DictReader(f, delimiter="\t") if int(row["step"]) <= start_step]
