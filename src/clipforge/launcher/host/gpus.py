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

from clipforge.util import RANKS_NOW_ENV

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
    devices: tuple[int, ...]
    """The devices the next attempt runs on, one rank each; () when it cannot run."""
    message: str

    @property
    def can_continue(self) -> bool:
        return bool(self.devices)

    @property
    def ranks(self) -> int:
        return len(self.devices)


def default_min_gpus(planned: int) -> int:
    """`--min-gpus` when not given: half the planned GPUs, rounded up."""
    return max(1, (planned + 1) // 2)


def ranks_for(planned: int, left: int) -> int:
    """How many of the `left` GPUs a run planned on `planned` can use: the largest divisor of
    `planned` that is not more than `left`. The global batch is micro x accumulation x planned,
    so it then splits over the ranks with the same micro batch (what fits in a GPU's memory) and
    a whole accumulation: 8 planned, 6 left -> 4 ranks, each accumulating twice as much."""
    return max(n for n in range(1, planned + 1) if planned % n == 0 and n <= max(left, 1))


def judge(
    planned: int, inventory: Inventory, min_gpus: int, cannot_shrink: str | None = None
) -> GpuVerdict:
    """What the next attempt can do with the GPUs left. Pure.

    With GPUs gone it goes on with fewer ranks (`ranks_for`), down to `min_gpus`; the train stage
    keeps the global batch and loads the checkpoint at the new data-parallel size (docs/faults.md,
    "Fewer GPUs, same run"). `cannot_shrink`: why this run cannot go on with fewer (None: it can).
    """
    lost = tuple(i for i in range(planned) if i not in inventory.usable)
    usable = tuple(i for i in inventory.usable if i < planned)
    if not lost:
        return GpuVerdict((), usable, f"all {planned} GPU(s) answer ({inventory.source})")
    devices = ", ".join(f"GPU {i}" for i in lost)
    gone = (
        f"{devices} of {planned} no longer answer{'s' if len(lost) == 1 else ''} "
        f"({inventory.source})"
    )
    ranks = ranks_for(planned, len(usable)) if usable else 0
    if ranks < min_gpus or cannot_shrink:
        if cannot_shrink:
            why = f"{len(usable)} left, but {cannot_shrink}"
        elif ranks == len(usable):
            why = f"{len(usable)} left, fewer than --min-gpus={min_gpus}"
        else:
            why = (
                f"{len(usable)} left, of which {ranks} keep the global batch (a divisor of "
                f"{planned}), fewer than --min-gpus={min_gpus}"
            )
        return GpuVerdict(
            lost,
            (),
            f"{gone}: {why}. Replace or reset the GPU, then `fab train --resume RUN`",
        )
    idle = len(usable) - ranks
    unused = (
        f"; {idle} more answer{'s' if idle == 1 else ''} but would not keep the global batch"
        if idle
        else ""
    )
    return GpuVerdict(
        lost,
        usable[:ranks],
        f"{gone}: going on with {ranks} rank(s) on GPU {', '.join(map(str, usable[:ranks]))}, "
        f"the same global batch{unused}",
    )


def attempt_argv(argv: list[str], ranks: int, devices: tuple[int, ...]) -> list[str]:
    """A phase's command for an attempt on `devices` only. Pure. A host command gets them through
    its environment (see `attempt_env`); a `docker run` passes its environment to docker, not to
    the container, so the container is given the devices (renumbered 0..n-1 inside) and the
    rank count on its own command line."""
    if argv[:2] != ["docker", "run"]:
        return argv
    out = [*argv[:2], "--env", f"{RANKS_NOW_ENV}={ranks}"]
    rest = argv[2:]
    i = 0
    while i < len(rest):
        if rest[i] == "--gpus" and i + 1 < len(rest):
            # docker reads the value as CSV: the quotes keep the device list one field
            out += ["--gpus", f'"device={",".join(map(str, devices))}"']
            i += 2
            continue
        out.append(rest[i])
        i += 1
    return out


def attempt_env(ranks: int, devices: tuple[int, ...]) -> dict[str, str]:
    """The environment of an attempt on `devices` only (a host command): the ranks for the train
    stage, and the devices it may see (nvidia-smi's indices are the CUDA ones unless
    CUDA_DEVICE_ORDER says otherwise: the supervisor sets PCI_BUS_ID order, nvidia-smi's)."""
    return {
        RANKS_NOW_ENV: str(ranks),
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices)),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
