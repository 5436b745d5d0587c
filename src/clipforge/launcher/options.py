"""Typed options of `fab train`, checked before anything touches a host, and the params they make.

`--set key=value` is DVC's `-S`: the same YAML-valued override the stages take, applied on the
host by `dvc exp run -S`. Here they are first resolved against the commit's params.yaml with the
stages' own loader, so a typo fails on the laptop, and the resolved params are recorded.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from clipforge.config import Config, ConfigError, load_config, parse_override
from clipforge.launcher import LauncherError

# A few steps with a checkpoint every two, and a warm-up shorter than the run. User --set win.
SMOKE_OVERRIDES = (
    "train.max_steps=4",
    "train.save_every_steps=2",
    "train.log_every_steps=1",
    "train.warmup_steps=1",
)
# A smoke run's global batch: this many pairs per rank, whatever the world size, so that any
# --gpus/--nodes divides it; micro batch and accumulation follow.
SMOKE_PAIRS_PER_RANK = 16
# Set from --gpus/--nodes; setting them with --set as well would be ambiguous.
LAUNCH_KEYS = ("train.ranks_per_node", "train.num_nodes")
DATA_MODES = ("pull", "build")


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    gpus: int  # per node; 0 = CPU ranks
    nodes: int
    overrides: tuple[str, ...] = ()
    smoke: bool = False
    runtime: Literal["docker", "host"]
    allow_dirty: bool = False
    # `pull` (DVC remote), `build` (run the data stage on the host) or an absolute path on the host
    # holding a data stage output (a mounted volume); `fab train --data auto` is resolved to one
    # of them first (launch.choose_data).
    data: str
    master_port: int = 29500
    max_restarts: int = 5
    # The fewest GPUs per node a run goes on with after losing some (None: half, rounded up;
    # clipforge.launcher.host.gpus); below it the run stops with the reason.
    min_gpus: int | None = None
    image: str | None = None
    user_overrides: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise LauncherError(f"--gpus: must be >= 0 (0 = CPU), got {self.gpus}")
        if self.nodes < 1:
            raise LauncherError(f"--nodes: must be >= 1, got {self.nodes}")
        if self.runtime not in ("docker", "host"):
            raise LauncherError(f"--runtime: `docker` or `host`, got {self.runtime!r}")
        if self.data not in DATA_MODES and not self.data.startswith("/"):
            raise LauncherError(
                f"--data: `auto`, `pull`, `build` or an absolute path on the host, got {self.data!r}"
            )
        if not 0 < self.master_port < 65536:
            raise LauncherError(f"--master-port: a TCP port, got {self.master_port}")
        if self.max_restarts < 0:
            raise LauncherError(f"--max-restarts: must be >= 0, got {self.max_restarts}")
        if self.min_gpus is not None and not 1 <= self.min_gpus <= max(self.gpus, 1):
            raise LauncherError(
                f"--min-gpus: 1..--gpus ({self.gpus}), the fewest GPUs per node a run goes on "
                f"with after losing some; got {self.min_gpus}"
            )
        for item in self.user_overrides:
            try:
                key, _ = parse_override(item)
            except ConfigError as exc:
                raise LauncherError(f"--set {item}: {exc}") from None
            if key in LAUNCH_KEYS:
                raise LauncherError(f"--set {key}: set by --gpus/--nodes; use those instead")

    @property
    def mounted_data(self) -> bool:
        return self.data not in DATA_MODES

    @property
    def through_dvc(self) -> bool:
        """The train stage runs as `dvc exp run`: one node, data that DVC manages. A multi-node run
        starts one DeepSpeed launcher per node, and a mounted volume must stay out of the DVC
        workspace (`dvc exp run` clears outputs it has no hash for, through symlinks too)."""
        return self.nodes == 1 and not self.mounted_data

    @property
    def env(self) -> dict[str, str]:
        return {"DS_ACCELERATOR": "cpu"} if self.gpus == 0 else {}


def make_options(
    *,
    gpus: int,
    nodes: int,
    sets: list[str],
    smoke: bool,
    runtime: str,
    allow_dirty: bool,
    data: str,
    **rest,
) -> TrainOptions:
    """Options with the overrides --gpus/--nodes/--smoke imply, then the user's, in that order."""
    launch = [f"train.num_nodes={nodes}"]
    launch += (
        ["train.device=cpu", "train.ranks_per_node=1"]
        if gpus == 0
        else [f"train.ranks_per_node={gpus}"]
    )
    smoke_sets = []
    if smoke:
        world = nodes * max(gpus, 1)
        smoke_sets = [
            *SMOKE_OVERRIDES,
            f"train.global_batch_size={SMOKE_PAIRS_PER_RANK * world}",
            "train.micro_batch_size=auto",
            "train.grad_accum_steps=auto",
        ]
    return TrainOptions(
        gpus=gpus,
        nodes=nodes,
        smoke=smoke,
        runtime=runtime,  # type: ignore[arg-type]  # __post_init__ checks it
        allow_dirty=allow_dirty,
        data=data,
        user_overrides=tuple(sets),
        overrides=tuple(launch + smoke_sets + list(sets)),
        **rest,
    )


def resolve_params(params_text: str | None, overrides: tuple[str, ...]) -> Config:
    """The params the run will train with: the commit's params.yaml + overrides, validated."""
    if params_text is None:
        raise LauncherError("the commit has no params.yaml; run fab from the clipforge project")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "params.yaml"
        path.write_text(params_text, encoding="utf-8")
        try:
            return load_config(path, list(overrides))
        except ConfigError as exc:
            raise LauncherError(f"params: {exc}") from None


def parse_count(value, flag: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LauncherError(f"{flag}: expected a whole number, got {value!r}") from None
