"""The names of a training run's checkpoints: the one module that knows them.

  <run dir>/step-00000100/                 a checkpoint: DeepSpeed's files, config.yaml and
  <run dir>/step-00000100/manifest.json      its manifest (size + sha256 of each file), last
  <run dir>/step-00000100/universal/         its DeepSpeed universal form, made when a restart
                                             loads it at another data-parallel size (not in the
                                             manifest: derived, remade from the files it lists)
  <run dir>/latest                         a hint: the tag of the newest checkpoint published
  <run dir>/damaged-<name>-<UTC time>      a checkpoint or marker found damaged, set aside
  <run dir>/.download-<tag>                a checkpoint being fetched from the run store
  <run dir>/writer.lock                    the advisory lock of the one trainer of the run

The run store holds the same names under `<remote>/<run id>/checkpoints/`, and the lease of the
trainer writing there in `<remote>/<run id>/lease.json`.

A checkpoint is whole when its manifest is there and every file it lists has its size
(`size_problem`), and intact when each also has its sha256 (`content_problem`): both proofs are
shared by the local disk and the store. A
save that has no manifest yet never finished; nothing else is ever removed by a start.

Standard library only: the host side (clipforge.launcher.host) ships it to the workers with a
bare python3 (see stored_checkpoints.script_source).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

LATEST = "latest"
CHECKPOINT_MANIFEST = "manifest.json"
WRITER_LOCK = "writer.lock"
STORE_CHECKPOINTS = "checkpoints"  # under <remote>/<run id>/
STORE_LEASE = "lease.json"  # under <remote>/<run id>/
UNIVERSAL = "universal"  # under a checkpoint: the universal form (ds_to_universal's output)
_UNIVERSAL_PARTIAL = ".universal-partial"  # under a checkpoint: a conversion under way
_TAG = re.compile(r"^step-(\d{8})$")
# DeepSpeed's ZeRO optimizer shards, one per data-parallel rank (stage 0 writes none: its one
# file holds the whole optimizer and loads at any size); `bf16_` with its BF16 optimizer.
_BF16_PREFIX = "bf16_"
_ZERO_SHARD = re.compile(rf"^(?:{_BF16_PREFIX})?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_DAMAGED = "damaged-"
_DOWNLOAD = ".download-"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def tag_step(name: str) -> int | None:
    """The step of a checkpoint tag; None for any other name."""
    match = _TAG.match(name)
    return int(match.group(1)) if match else None


def step_of(tag: str) -> int:
    step = tag_step(tag)
    if step is None:
        raise ValueError(f"not a checkpoint tag: {tag!r}")
    return step


def universal_partial_name() -> str:
    """The name a conversion to the universal form writes under before it is renamed."""
    return _UNIVERSAL_PARTIAL


def data_parallel_size(names: list[str]) -> int | None:
    """The data-parallel size a checkpoint was saved at, from the names of its files (DeepSpeed's
    ZeRO shards: one per rank); None when it has none (ZeRO stage 0), which loads at any size."""
    return len(optimizer_shards(names)) or None


def optimizer_shards(names: list[str]) -> list[str]:
    """A checkpoint's optimizer shards among the names of its files, in rank order (empty at ZeRO
    stage 0)."""
    by_rank = {int(m.group(1)): m.group(0) for m in map(_ZERO_SHARD.match, names) if m}
    return [by_rank[rank] for rank in sorted(by_rank)]


def written_by_bf16_optimizer(shards: list[str]) -> bool:
    """Whether DeepSpeed's bf16 mode (its BF16_Optimizer: bf16 weights, fp32 master weights, ZeRO-1
    partitions) wrote these optimizer shards, rather than a ZeRO optimizer."""
    return bool(shards) and all(name.startswith(_BF16_PREFIX) for name in shards)


def marker_text(tag: str) -> str:
    return f"{tag}\n"


def marker_tag(text: str) -> str | None:
    """The tag a `latest` marker names; None when it names none (garbage, empty)."""
    tag = text.strip()
    return tag if tag_step(tag) is not None else None


def damaged_name(name: str, when: float | None = None, attempt: int = 0) -> str:
    """The name a damaged checkpoint (or marker) `name` is set aside under; `attempt` > 0 when
    that name is taken (two set asides in one second)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(time.time() if when is None else when))
    return f"{_DAMAGED}{name}-{stamp}" + (f"-{attempt}" if attempt else "")


def download_name(tag: str) -> str:
    return f"{_DOWNLOAD}{tag}"


def is_download(name: str) -> bool:
    return name.startswith(_DOWNLOAD)


def parse_manifest(text: str | bytes) -> dict | None:
    """A manifest's content, or None when it is not one."""
    try:
        manifest = json.loads(text)
    except ValueError:
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    files = manifest["files"]
    if not all(isinstance(v, dict) and isinstance(v.get("bytes"), int) for v in files.values()):
        return None
    return manifest


def size_problem(manifest: dict, sizes: dict[str, int]) -> str | None:
    """What is wrong with a checkpoint whose files have `sizes` (path relative to it -> bytes),
    against its manifest, in a few words; None when every file listed is there with its size."""
    for name, expected in manifest["files"].items():
        if name not in sizes:
            return f"{name} is missing"
        size, want = sizes[name], expected["bytes"]
        if size != want:
            what = "emptied" if size == 0 else "truncated" if size < want else "grown"
            return f"{name} is {what}: {size:,} bytes, the manifest says {want:,}"
    return None


def content_problem(manifest: dict, sha256_of: Callable[[str], str]) -> str | None:
    """What is wrong with a checkpoint's bytes against its manifest (`sha256_of`: a file's
    sha256, by its path relative to the checkpoint, wherever it is kept); None when every file
    matches. The one byte-level proof: the resume's (on disk) and the guards' (in the store)."""
    for name, expected in manifest["files"].items():
        if sha256_of(name) != expected.get("sha256"):
            return f"{name} does not match its sha256 in the manifest (changed since it was saved)"
    return None
