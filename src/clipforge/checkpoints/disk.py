"""Disk faults where the train stage writes: permission and free space.

Permission and free space, checked before writing and
named after a failed write (torch reports a full disk as `enforce fail at inline_container.cc`
and a read-only directory as a missing parent). Standard library only: the stage shell checks
its output folders with it before importing torch.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from clipforge.errors import AccessDenied, DiskFull, StageError

# A DeepSpeed checkpoint holds each parameter about four times in fp32: the weights, the
# optimizer's master copy and AdamW's two moments (measured: 16.0 bytes per parameter).
CHECKPOINT_BYTES_PER_PARAMETER = 16


@dataclass(frozen=True)
class DiskSpace:
    """Free bytes where the next checkpoint goes, and its expected size."""

    path: Path
    free: int
    need: int

    @property
    def full(self) -> bool:
        return self.free < self.need

    @property
    def low(self) -> bool:
        """After the next checkpoint, less room than for one more: warn while there is time."""
        return self.free < 2 * self.need

    def full_message(self) -> str:
        return (
            f"disk full at {self.path}: {self.free:,} bytes free, a checkpoint needs "
            f"~{self.need:,} bytes; free space there (or give --checkpoints another disk) and "
            f"rerun the stage to resume from the last checkpoint"
        )


def nearest_existing(path: Path) -> Path:
    """`path`, or its closest ancestor that exists (where a new directory would be made)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def not_writable_message(path: Path) -> str | None:
    """Why files cannot be created under `path` (a read-only mount, missing permission)."""
    existing = nearest_existing(path)
    if os.access(existing, os.W_OK | os.X_OK):
        return None
    above = existing != Path(os.path.abspath(path))
    return (
        f"no permission to write {path}"
        + (f" ({existing} is read-only or not writable)" if above else "")
        + "; make it writable or choose another folder"
    )


def disk_space(path: Path, need: int) -> DiskSpace:
    return DiskSpace(path, shutil.disk_usage(nearest_existing(path)).free, need)


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (a checkpoint directory)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def write_failure(path: Path, need: int, step: int | None = None) -> StageError | None:
    """What a failed write under `path` means, when the file system says it: no permission, or
    too little space for `need` bytes (measured now: the caller has removed what it left). None:
    something else went wrong. `step`: the run's last step, for the supervisor's record."""
    denied = not_writable_message(path)
    if denied:
        return AccessDenied(denied, step=step)
    space = disk_space(path, need)
    return DiskFull(space.full_message(), step=step) if space.full else None
