"""Which GPUs of this node are usable now, and what a restart can do about the missing ones.

Read before every attempt of a phase, because a GPU that fell off the bus (Xid 79) makes every
restart fail the same way: restarting on the same GPUs only spends the restart budget. On GPU
hosts `nvidia-smi` answers; on CPU hosts (and in tests) a fault hook stands in for it: the file
NODE_DIR/fault-usable-gpus, holding the indices that still answer (e.g. `0`), as written by a
test that "loses" a device. Standard library only (the supervisor runs it).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

NVIDIA_SMI_TIMEOUT_SECONDS = 30.0
FAULT_FILE = "fault-usable-gpus"


@dataclass(frozen=True)
class Inventory:
    usable: tuple[int, ...]
    """Indices of the GPUs that answer."""
    source: str
    """How they were found: "nvidia-smi", the fault hook's path, or why nothing could tell."""


def read_inventory(node_dir: str, planned: int) -> Inventory | None:
    """The usable GPUs, or None when nothing can tell (no nvidia-smi, a CPU run)."""
    hook = Path(node_dir) / FAULT_FILE
    if hook.is_file():
        return Inventory(parse_indices(hook.read_text(encoding="utf-8")), str(hook))
    if planned == 0:
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        # A GPU that fell off the bus can make nvidia-smi hang: as good as none answering.
        return Inventory((), "nvidia-smi (timed out)")
    # nvidia-smi exits non-zero when a GPU is lost ("Unable to determine the device handle for
    # GPU 0000:3B:00.0: Unknown Error") yet still lists the ones that answer.
    return Inventory(parse_indices(done.stdout), "nvidia-smi")


def parse_indices(text: str) -> tuple[int, ...]:
    """`0\\n1\\n3\\n` (nvidia-smi's csv, noheader) or `0,1,3` -> (0, 1, 3); other lines (error
    messages mixed into the output) are skipped."""
    found = set()
    for line in text.replace(",", "\n").splitlines():
        item = line.strip()
        if item.isdigit():
            found.add(int(item))
    return tuple(sorted(found))


@dataclass(frozen=True)
class GpuVerdict:
    lost: tuple[int, ...]
    """Planned devices (0..planned-1) that no longer answer."""
    can_continue: bool
    message: str


def judge(planned: int, inventory: Inventory, min_gpus: int) -> GpuVerdict:
    """What the next attempt can do with the GPUs left. Pure.

    Continuing on fewer GPUs than planned needs a checkpoint that loads at another
    data-parallel size, which this version does not have (docs/launcher.md, "Fewer GPUs"):
    so a loss stops the run at once with the reason, rather than spending every restart on
    the same failure. `min_gpus` is the floor a reshaped run would keep."""
    lost = tuple(i for i in range(planned) if i not in inventory.usable)
    left = planned - len(lost)
    if not lost:
        return GpuVerdict((), True, f"all {planned} GPU(s) answer ({inventory.source})")
    devices = ", ".join(f"GPU {i}" for i in lost)
    if left < min_gpus:
        why = f"{left} left, fewer than --min-gpus={min_gpus}"
    else:
        why = (
            f"{left} left (>= --min-gpus={min_gpus}), but a restart on fewer GPUs than the "
            f"run's {planned} needs a checkpoint that loads at another data-parallel size, "
            f"not implemented yet"
        )
    return GpuVerdict(
        lost,
        False,
        f"{devices} of {planned} no longer answer{'s' if len(lost) == 1 else ''} "
        f"({inventory.source}): {why}. Replace or reset the GPU, then `fab train --resume RUN`",
    )
