"""What a run reports while it trains: TensorBoard events, TSVs for `dvc plots`, progress.

Only rank 0 writes. On resume, TensorBoard is told to purge events after the checkpoint's step
and the TSVs keep only this run's rows up to it, so curves have no doubled segments. Every TSV
row carries the run id: a reader (`fab status`) can tell this run's rows from a file another
run left in the checkout.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from clipforge.metrics.retrieval import METRIC_KEYS
from clipforge.util import format_duration

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
    "run_id",
)
# One row per validation: the val loss and retrieval recall curves.
VAL_COLUMNS = ("step", "loss", *METRIC_KEYS, "run_id")
_TB_NAMES = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "logit_scale": "train/logit_scale",
    "logit_bias": "train/logit_bias",  # SigLIP's (train.loss: siglip); not in the TSV's columns
    "samples_per_s": "perf/samples_per_s",
    "step_s": "perf/step_s",
    "data_wait_s": "perf/data_wait_s",
    "data_wait_share": "perf/data_wait_share",
    "mfu": "perf/mfu",
    "peak_mem_gb": "perf/peak_mem_gb",
}
# The scalars TensorBoard's hparams table shows next to each run's hyperparameters.
HPARAM_METRICS = ("train/loss", "val/loss", "val/mean_recall", "val/t2i_r01")


def run_label(
    model_name: str, global_batch_size: int, lr: float, zero_stage: int, run_id: str
) -> str:
    """The run's name in TensorBoard (its log directory): what tells runs apart at a glance,
    then the run id that names its checkpoints."""
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name)
    return f"{model}-b{global_batch_size}-lr{lr:g}-zero{zero_stage}-{run_id}"


class TsvLog:
    """A TSV that grows by one row at a time, rewritten whole each time (small: one row per log
    interval; never torn). Started at a resumed step, it keeps the run's own rows up to it."""

    def __init__(self, path: Path, columns: tuple[str, ...], run_id: str, start_step: int):
        self.path, self.columns, self.run_id = path, columns, run_id
        self.rows = _kept_rows(path, run_id, start_step)
        self._write()

    def append(self, values: dict) -> None:
        row = {c: values.get(c, "") for c in self.columns}
        row["run_id"] = self.run_id
        self.rows.append(row)
        self._write()

    def _write(self) -> None:
        from clipforge.fsutil import atomic_write_text

        lines = ["\t".join(self.columns)]
        lines += ["\t".join(_fmt(row[c]) for c in self.columns) for row in self.rows]
        atomic_write_text(self.path, "\n".join(lines) + "\n")


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


class TrainReport:
    def __init__(
        self,
        log_dir: Path,
        metrics_dir: Path,
        run_id: str,
        start_step: int,
        total_steps: int,
        interactive: bool | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)
        self.train_rows = TsvLog(metrics_dir / "train.tsv", COLUMNS, run_id, start_step)
        self.val_rows = TsvLog(metrics_dir / "val.tsv", VAL_COLUMNS, run_id, start_step)
        self.start_step = start_step
        self.total_steps = total_steps
        self.started = time.monotonic()
        interactive = sys.stderr.isatty() if interactive is None else interactive
        self.bar = None
        self._logs_above_bar = contextlib.ExitStack()
        if interactive:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            # A log line written while the bar is drawn would go on after it, on the bar's line:
            # the root logger's handlers write through tqdm, which clears the bar first.
            self._logs_above_bar.enter_context(logging_redirect_tqdm())

    def hparams(self, values: dict[str, int | float | str | bool]) -> None:
        """The run's hyperparameters for TensorBoard's hparams table, in the run's own events
        (SummaryWriter.add_hparams would start another run beside it)."""
        from torch.utils.tensorboard.summary import hparams

        writer = self.writer._get_file_writer()
        for summary in hparams(values, dict.fromkeys(HPARAM_METRICS, 0.0)):
            writer.add_summary(summary)

    def step(self, step: int, scalars: dict[str, float]) -> None:
        """Record the scalars of optimizer step `step` (1-based: steps done so far)."""
        for name, value in scalars.items():
            if name in _TB_NAMES and value is not None:
                self.writer.add_scalar(_TB_NAMES[name], value, step)
        self.train_rows.append({**scalars, "step": step})
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

    def validation(self, step: int, metrics: dict[str, float]) -> None:
        """val/loss, val/t2i_r01, ..., val/mean_recall: TensorBoard, val.tsv and the log."""
        for name, value in metrics.items():
            self.writer.add_scalar(f"val/{name}", value, step)
        self.val_rows.append({**metrics, "step": step})
        log.info(
            "step %d: validation %s", step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        )

    def retrieval_samples(self, step: int, grid, texts: dict[str, str]) -> None:
        """What a few validation queries retrieve (clipforge.train.retrieval_grid): a grid, texts."""
        self.writer.add_image("samples/text_to_image", grid, step, dataformats="HWC")
        for tag, text in texts.items():
            self.writer.add_text(tag, text, step)

    def store_lag(self, step: int, lag_steps: int, lag_seconds: float) -> None:
        """How far the run store is behind, as a checkpoint is saved (clipforge.store.uploader)."""
        self.writer.add_scalar("store/lag_steps", lag_steps, step)
        self.writer.add_scalar("store/lag_seconds", lag_seconds, step)

    def eta(self, step: int) -> str:
        """Time left at this run's pace (`step` follows at least one step of this process)."""
        per_step = (time.monotonic() - self.started) / (step - self.start_step)
        return format_duration(per_step * (self.total_steps - step))

    def close(self) -> None:
        self.writer.close()
        if self.bar is not None:
            self._logs_above_bar.close()
            self.bar.close()


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _fmt(value) -> str:
    if value is None:  # e.g. no grad norm on a skipped step, no MFU without a known peak
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _kept_rows(path: Path, run_id: str, start_step: int) -> list[dict]:
    if not start_step or not path.is_file():
        return []
    with open(path, encoding="utf-8", newline="") as f:
        return [
            row
            for row in csv.DictReader(f, delimiter="\t")
            if row.get("run_id") == run_id and int(row["step"]) <= start_step
        ]
