"""Which GPUs of this node are usable now, and what a restart can do about the missing ones.

Read before every attempt of a phase, because a GPU that fell off the bus (Xid 79) makes every
restart fail the same way: restarting on the same GPUs only spends the restart budget. On GPU
hosts `nvidia-smi` answers; on CPU hosts (and in tests) a fault hook stands in for it: the file
NODE_DIR/fault-usable-gpus, holding the indices that still answer (e.g. `0`), as written by a
test that "loses" a device. Standard library only (the supervisor runs it).

A run of several nodes runs the same number of ranks on every node (DeepSpeed's launcher gives
each node its slots; the world is nodes x ranks), so its nodes agree on one count before each
attempt of the train phase: `agree` is the rule, the records below are what the nodes exchange
on the run's shared storage, and the supervisor of node 0, where the process group meets, takes
the decision (clipforge.launcher.host.supervisor, `_agreed`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from clipforge.errors import UserError
from clipforge.util import RANKS_NOW_ENV, read_record_file, record_json, typed_fields

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


@dataclass(frozen=True)
class Agreement:
    """What every node of a multi-node run goes on with (`agree`)."""

    ranks: int
    """Per node, the same on every node; 0: the run cannot go on."""
    message: str


def agree(planned: int, usable: Mapping[int, int], min_gpus: int) -> Agreement:
    """The ranks per node of a run of several nodes, from each node's count of usable GPUs (node
    rank -> count). Pure.

    Every node runs the same number, so it is `ranks_for` of the fewest GPUs left on any node:
    the largest divisor of the planned count per node that is not more than that. The world,
    nodes x ranks, then divides the planned world (nodes x planned), so the global batch splits
    with the same micro batch and a whole accumulation, as on one node. Below `min_gpus` (per
    node, as --min-gpus is) the run cannot go on: every node stops."""
    short = {rank: count for rank, count in sorted(usable.items()) if count < planned}
    if not short:
        return Agreement(planned, f"all {planned} GPU(s) answer on every node")
    fewest = min(short.values())
    ranks = ranks_for(planned, fewest) if fewest else 0
    where = ", ".join(f"node {rank} has {count} of {planned}" for rank, count in short.items())
    if ranks < min_gpus:
        kept = f"{ranks} per node keep the global batch" if ranks else "none left there"
        return Agreement(
            0, f"{where}: {kept}, fewer than --min-gpus={min_gpus} (every node runs as many)"
        )
    return Agreement(
        ranks,
        f"{where}: every node goes on with {ranks} of {planned} rank(s), the same global batch",
    )


def judge(
    planned: int, inventory: Inventory, min_gpus: int, agreed: Agreement | None = None
) -> GpuVerdict:
    """What the next attempt can do with the GPUs left. Pure.

    With GPUs gone it goes on with fewer ranks (`ranks_for`), down to `min_gpus`; the train stage
    keeps the global batch and loads the checkpoint at the new data-parallel size (docs/faults.md,
    "Fewer GPUs, same run"). `agreed`: a phase that spans several nodes runs the ranks its nodes
    agreed on (`agree`), whatever this node's own count allows.
    """
    lost = tuple(i for i in range(planned) if i not in inventory.usable)
    usable = tuple(i for i in inventory.usable if i < planned)
    devices = ", ".join(f"GPU {i}" for i in lost)
    gone = (
        f"{devices} of {planned} no longer answer{'s' if len(lost) == 1 else ''} "
        f"({inventory.source})"
    )
    if agreed is not None:
        here = gone if lost else f"all {planned} GPU(s) answer here ({inventory.source})"
        if agreed.ranks == 0:
            return GpuVerdict(
                lost,
                (),
                f"{here}; {agreed.message}. Replace or reset the GPU, then `fab train --resume "
                f"RUN`",
            )
        on = usable[: agreed.ranks]
        if agreed.ranks == planned:
            return GpuVerdict(lost, on, f"{here}; {agreed.message}")
        return GpuVerdict(
            lost, on, f"{here}; {agreed.message}: here on GPU {', '.join(map(str, on))}"
        )
    if not lost:
        return GpuVerdict((), usable, f"all {planned} GPU(s) answer ({inventory.source})")
    ranks = ranks_for(planned, len(usable)) if usable else 0
    if ranks < min_gpus:
        if ranks == len(usable):
            why = f"{len(usable)} left, fewer than --min-gpus={min_gpus}"
        else:
            why = (
                f"{len(usable)} left, of which {ranks} keep the global batch (a divisor of "
                f"{planned}), fewer than --min-gpus={min_gpus}"
            )
        return GpuVerdict(
            lost,
            (),
            f"{gone}: {why}. Replace or reset the GPU, then `fab train --resume ID`",
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


class GpuRecordError(UserError, ValueError):
    """A node's GPU report, or node 0's decision, exists but is damaged; the message says why."""


@dataclass(frozen=True)
class GpuReport:
    """One node's usable GPUs before an attempt of a phase that spans the nodes, on the run's
    shared storage (NodeLayout.gpu_report)."""

    node_rank: int
    host: str
    seq: int
    """This node's reports, counted: node 0 decides only on reports newer than its last
    decision's, so each decision covers every node's attempt that is about to start."""
    usable: tuple[int, ...]
    source: str
    at: float

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "usable": list(self.usable)}, indent=2) + "\n"


@dataclass(frozen=True)
class GpuDecision:
    """Node 0's decision for the next attempt of every node (NodeLayout.gpu_decision)."""

    seen: dict[str, int]
    """Node rank (a JSON key: text) -> the seq of its report this decision took."""
    ranks: int
    """Per node; 0: the run cannot go on."""
    message: str
    usable: dict[str, list[int]]
    """Node rank -> its usable GPUs, as reported."""
    hosts: dict[str, str]
    at: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @property
    def agreement(self) -> Agreement:
        return Agreement(self.ranks, self.message)


_REPORT_TYPES: dict[str, tuple[type, ...]] = {
    "node_rank": (int,),
    "host": (str,),
    "seq": (int,),
    "usable": (list,),
    "source": (str,),
    "at": (int, float),
}
_DECISION_TYPES: dict[str, tuple[type, ...]] = {
    "seen": (dict,),
    "ranks": (int,),
    "message": (str,),
    "usable": (dict,),
    "hosts": (dict,),
    "at": (int, float),
}


def _fields(text: str, source: str, types: dict[str, tuple[type, ...]]) -> dict:
    raw = record_json(text, source, GpuRecordError)
    if not isinstance(raw, dict):
        raise GpuRecordError(f"{source}: not a JSON object")
    values = typed_fields(raw, types, source, GpuRecordError)
    missing = sorted(set(types) - set(values))
    if missing:
        raise GpuRecordError(f"{source}: missing {', '.join(missing)}")
    return values


def parse_report(text: str, source: str) -> GpuReport:
    values = _fields(text, source, _REPORT_TYPES)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in values["usable"]):
        raise GpuRecordError(f"{source}: usable is {values['usable']!r}, not GPU indices")
    return GpuReport(**{**values, "usable": tuple(values["usable"])})


def parse_decision(text: str, source: str) -> GpuDecision:
    return GpuDecision(**_fields(text, source, _DECISION_TYPES))


def read_report(path: str) -> GpuReport | None:
    """The report at `path`; None when there is none yet; GpuRecordError when it is damaged."""
    return read_record_file(path, parse_report)


def read_decision(path: str) -> GpuDecision | None:
    return read_record_file(path, parse_decision)


def decide(planned: int, reports: Mapping[int, GpuReport], min_gpus: int) -> GpuDecision:
    """Node 0's decision on every node's report (`agree`). Pure."""
    agreement = agree(
        planned,
        {r: len([i for i in p.usable if i < planned]) for r, p in reports.items()},
        min_gpus,
    )
    return GpuDecision(
        seen={str(r): p.seq for r, p in reports.items()},
        ranks=agreement.ranks,
        message=agreement.message,
        usable={str(r): list(p.usable) for r, p in reports.items()},
        hosts={str(r): p.host for r, p in reports.items()},
        at=max((p.at for p in reports.values()), default=0.0),
    )


def hostfile_node(rank: int) -> str:
    """Node `rank`'s name in DeepSpeed's hostfile (clipforge.launcher.commands writes it): in
    no-SSH mode nothing connects to it; it sizes the world and orders the nodes."""
    return f"node-{rank}"


def spanning_attempt_argv(
    argv: list[str], ranks: int, devices: tuple[int, ...], node_rank: int, num_nodes: int
) -> list[str]:
    """One node's DeepSpeed launcher (no-SSH mode, clipforge.launcher.commands) for an attempt of
    `ranks` per node, this node's on `devices`. Pure.

    On the host, `--include node-0:…@node-1:…` in place of `--num_nodes N --num_gpus G`: the
    launcher sets each rank's CUDA_VISIBLE_DEVICES from it (it would take GPUs 0..n-1 from
    --num_gpus), and it counts a node's ranks from its list, so the other nodes' entries only
    need the right length (0..n-1: their own launchers pick their devices). In a container
    (`docker run`), which sees only its devices, renumbered, `--num_gpus` is just the count."""
    if argv[:2] == ["docker", "run"]:
        out = attempt_argv(argv, ranks, devices)
        at = out.index("--num_gpus")  # ValueError: not a DeepSpeed launcher's command (a bug)
        return [*out[: at + 1], str(ranks), *out[at + 2 :]]
    at = argv.index("--num_gpus")
    include = "@".join(
        hostfile_node(rank)
        + ":"
        + ",".join(map(str, devices if rank == node_rank else range(ranks)))
        for rank in range(num_nodes)
    )
    out = [*argv[:at], "--include", include, *argv[at + 2 :]]
    if "--num_nodes" in out:  # exclusive with --include; the include names every node
        nodes = out.index("--num_nodes")
        del out[nodes : nodes + 2]
    return out


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
