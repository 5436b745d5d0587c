"""A run's record as a reader sees it: the steps of its metrics TSVs and TensorBoard events."""

from __future__ import annotations

from pathlib import Path


def tsv_steps(code: Path, name: str = "train.tsv") -> list[int]:
    """The step column of metrics/NAME, in file order (duplicates kept: they are the fault)."""
    path = code / "metrics" / name
    if not path.is_file():
        return []
    return [int(line.split("\t")[0]) for line in path.read_text().splitlines()[1:]]


def event_steps(code: Path, tag: str = "train/loss") -> list[int]:
    """The steps of TAG in the run's TensorBoard events as TensorBoard shows them: events a
    restart purged (SummaryWriter's purge_step) are left out, as TensorBoard leaves them out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log_dir,) = [p for p in (code / "logs").iterdir() if p.is_dir()]
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [event.step for event in events.Scalars(tag)]
