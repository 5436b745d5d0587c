"""Typed options of `fab train`, checked before anything touches a host, and the params they make.

`--set key=value` is DVC's `-S`: the same YAML-valued override the stages take, applied on the
host by `dvc exp run -S`. Here they are first resolved against the commit's params.yaml with the
stages' own loader, so a typo fails on the laptop, and the resolved params are recorded.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from clipforge.config import parse_override
from clipforge.errors import LauncherError
from clipforge.fields import REQUIRED, ConfigError, knob
from clipforge.launcher.host.plan import RestartLimits
from clipforge.pipeline.params import PipelineParams, load_pipeline_params
from clipforge.util import short_repr

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


def _data_mode(key: str, value: str) -> str:
    if value not in DATA_MODES and not value.startswith("/"):
        raise LauncherError(
            f"{key}: `auto`, `pull`, `build` or an absolute path on the host, got "
            f"{short_repr(value)}"
        )
    return value


def _user_sets(key: str, value: tuple[str, ...]) -> tuple[str, ...]:
    for item in value:
        try:
            name, _ = parse_override(item)
        except ConfigError as exc:
            raise LauncherError(f"{key} {item}: {exc}") from None
        if name in LAUNCH_KEYS:
            raise LauncherError(f"{key} {name}: set by --gpus/--nodes; use those instead")
    return value


@dataclass(frozen=True, kw_only=True)
class TrainOptions(RestartLimits):
    """`fab train`'s options, each named by its flag; --max-restarts and --min-gpus are the
    restart policy's (host.plan.RestartLimits), declared once there."""

    gpus: int = knob(REQUIRED, "GPUs per node; 0: CPU ranks", ge=0)
    nodes: int = knob(REQUIRED, "nodes the run trains on", ge=1)
    overrides: tuple[str, ...] = knob(
        (), "what the run trains with: --gpus/--nodes/--smoke's overrides, then the user's --set"
    )
    smoke: bool = knob(False, "a few steps with a checkpoint every two")
    runtime: Literal["docker", "host"] = knob(
        REQUIRED, "the host's own Python stack, or the pinned image"
    )
    allow_dirty: bool = knob(False, "ship the commit even though the work tree has changes")
    data: str = knob(
        REQUIRED,
        "`pull` (DVC remote), `build` (run the data stage on the host) or an absolute path on the "
        "host holding a data stage output (a mounted volume); `fab train --data auto` is "
        "resolved to one of them first (launch.choose_data)",
        check=_data_mode,
    )
    master_port: int = knob(29500, "node 0's rendezvous port", ge=1, le=65535)
    allow_public_master: bool = knob(
        False, "node 0's rendezvous may listen on a public address (its port firewalled)"
    )
    image: str | None = knob(None, "image reference (None: docker/image.env, with $REGISTRY)")
    user_overrides: tuple[str, ...] = knob((), "the user's --set key=value", check=_user_sets)

    @classmethod
    def key_of(cls, name: str) -> str:
        return "--set" if name == "user_overrides" else super().key_of(name)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_gpus is not None and not self.min_gpus <= max(self.gpus, 1):
            raise LauncherError(
                f"--min-gpus: 1..--gpus ({self.gpus}), the fewest GPUs per node a run goes on "
                f"with after losing some; got {self.min_gpus}"
            )

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


def resolve_params(params_text: str | None, overrides: tuple[str, ...]) -> PipelineParams:
    """The params the run will train with: the commit's params.yaml + overrides, validated."""
    if params_text is None:
        raise LauncherError("the commit has no params.yaml; run fab from the clipforge project")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "params.yaml"
        path.write_text(params_text, encoding="utf-8")
        try:
            return load_pipeline_params(path, list(overrides))
        except ConfigError as exc:
            raise LauncherError(f"params: {exc}") from None


def checkout_store(start: Path) -> str | None:
    """storage.remote of the checkout's params.yaml: where a run is looked for when no host has
    it and no --store is given."""
    params = start / "params.yaml"
    if not params.is_file():
        return None
    return resolve_params(params.read_text(encoding="utf-8"), ()).storage.remote


def parse_count(value, flag: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LauncherError(f"{flag}: expected a whole number, got {short_repr(value)}") from None
