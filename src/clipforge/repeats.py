"""A launch that repeats an earlier run (`fab rerun`): what it must find unchanged, and the check.

`fab rerun` writes the run record's `repeats` field (clipforge.launcher.host.record.RunRecord):
the run it repeats, that run's data manifest (its sha256, and the manifest itself where the run
kept it: train.info.json's `data_manifest`), the software stack that trained it (train.info.json's
environment record) and whether a different stack is allowed. The train stage reads it from the
launch's record (CLIPFORGE_RUN_RECORD) and, before anything is trained, refuses in one line:
- data whose manifest is not the recorded one, naming the first shard (or file) that differs;
- a stack that differs from the recorded one, naming each version (`torch 2.1.2 -> 2.4.0`),
  unless the rerun was started with --allow-stack-change (then they are logged and it goes on).
A rerun is a training run of its own: its run id takes its launch id in (clipforge.train.config),
so it trains from step 0 rather than resuming the original's checkpoints in the run store.

Standard library only: the stage reads it before the training stack is imported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from clipforge.errors import StackMismatch, StageError
from clipforge.util import flatten

RECORD_KEY = "repeats"  # the run record's field
# The stack's fields that decide the numbers, in the order they are named. CUDA, cuDNN and NCCL
# as torch reports them are read only once torch is imported; before that, torch's own version
# (its local tag says the CUDA build) and the package list's hash stand for them.
STACK_FIELDS = (
    "python",
    "torch",
    "cuda",
    "cudnn",
    "nccl",
    "deepspeed",
    "open_clip",
    "transformers",
)


class DataMoved(StageError):
    """The data is not the data the repeated run trained on."""


class StackChanged(StackMismatch):
    """The software stack is not the one the repeated run trained with."""


@dataclass(frozen=True, kw_only=True)
class Repeats:
    launch_id: str | None  # the repeated run's launch (None: a run `fab train` did not start)
    run: str  # how the user named it (a folder, a launch id)
    training_run: str | None  # its training run id (run-<sha12>)
    data_manifest_sha256: str | None
    data_manifest: dict | None  # the manifest itself, where the run kept it
    stack: dict | None  # the train stage's stack (clipforge.envrecord.Stack as a dict)
    allow_stack_change: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def repeats_from_dict(raw: object, source: str) -> Repeats:
    """The one reader of the field; StageError naming `source` when it is not one."""
    names = {f.name for f in dataclasses.fields(Repeats)}
    if not isinstance(raw, dict) or not {"run", "data_manifest_sha256"} <= set(raw):
        raise StageError(f"{source}: `{RECORD_KEY}` is not a record of the run repeated")
    return Repeats(**{k: v for k, v in raw.items() if k in names})


def of_record(record: dict | None, source: str = "run.json") -> Repeats | None:
    """What a run record (parsed run.json) says the launch repeats; None: not a rerun."""
    raw = (record or {}).get(RECORD_KEY)
    return None if raw is None else repeats_from_dict(raw, source)


def read_record(path: str | None) -> dict | None:
    """The launch's run record at `path` (CLIPFORGE_RUN_RECORD); None without one. A record that
    cannot be read is an error here: a rerun must not train unchecked."""
    if not path:
        return None
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StageError(f"{path}: the launch's run record is not readable ({exc})") from None
    return value if isinstance(value, dict) else None


def rerun_launch(record: dict | None) -> str | None:
    """The launch id a rerun's training run id takes in (None: not a rerun)."""
    if (record or {}).get(RECORD_KEY) is None:
        return None
    launch_id = record.get("launch_id") if record else None
    return launch_id if isinstance(launch_id, str) else None


# -- the data ------------------------------------------------------------------------------------
def check_data(repeats: Repeats, manifest: Path, raw: bytes) -> None:
    """DataMoved, in one line, when `raw` (manifest's bytes) is not the recorded manifest."""
    expected = repeats.data_manifest_sha256
    if expected is None:
        raise DataMoved(
            f"the run repeated ({repeats.run}) recorded no data manifest sha256: its data cannot "
            "be checked, so it is not repeated"
        )
    found = hashlib.sha256(raw).hexdigest()
    if found == expected:
        return
    what = "its content differs"
    if repeats.data_manifest is not None:
        try:
            current = json.loads(raw)
        except ValueError:
            current = None
        if isinstance(current, dict):
            what = manifest_difference(repeats.data_manifest, current) or what
    raise DataMoved(
        f"the data moved since run {repeats.run}: {manifest} has sha256 {found[:12]}, the run "
        f"trained on {expected[:12]}; first difference: {what}; nothing was trained"
    )


def manifest_difference(recorded: dict, current: dict) -> str | None:
    """The first difference between two data manifests: a shard of a split first (by name:
    changed, missing or new), then any other entry (the source, the test set's files)."""
    for split in _splits(recorded) | _splits(current):
        old, new = _shards(recorded, split), _shards(current, split)
        for name in list(old) + [n for n in new if n not in old]:
            if name not in new:
                return f"{split} shard {name} is gone"
            if name not in old:
                return f"{split} shard {name} is new"
            if old[name] != new[name]:
                was, now = old[name], new[name]
                key = next(k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))
                return (
                    f"{split} shard {name}: {key} {_short(was.get(key))} -> {_short(now.get(key))}"
                )
    flat_old, flat_new = flatten(_without_shards(recorded)), flatten(_without_shards(current))
    for key in sorted(set(flat_old) | set(flat_new)):
        if flat_old.get(key) != flat_new.get(key):
            return f"{key}: {_short(flat_old.get(key))} -> {_short(flat_new.get(key))}"
    return None


def _splits(manifest: dict) -> set[str]:
    splits = manifest.get("splits")
    return (
        {k for k, v in splits.items() if isinstance(v, dict)} if isinstance(splits, dict) else set()
    )


def _shards(manifest: dict, split: str) -> dict[str, dict]:
    entry = (manifest.get("splits") or {}).get(split) or {}
    shards = entry.get("shards") if isinstance(entry, dict) else None
    return {
        str(s.get("name")): s
        for s in (shards if isinstance(shards, list) else [])
        if isinstance(s, dict)
    }


def _without_shards(manifest: dict) -> dict:
    splits = {
        name: {k: v for k, v in entry.items() if k != "shards"}
        if isinstance(entry, dict)
        else entry
        for name, entry in (manifest.get("splits") or {}).items()
    }
    return {**manifest, "splits": splits}


def _short(value: object) -> str:
    if value is None:
        return "(none)"
    text = str(value)
    return text[:12] if len(text) == 64 else text[:80]  # a sha256 by its first 12 digits


# -- the stack -----------------------------------------------------------------------------------
def stack_changes(recorded: dict, current: dict) -> list[str]:
    """Each difference that may change the numbers, as `torch 2.1.2 -> 2.4.0`; a field read only
    once torch is imported (None here) is not compared. Then the full package list's hash."""
    changes = [
        f"{name} {recorded.get(name)} -> {current.get(name)}"
        for name in STACK_FIELDS
        if current.get(name) is not None and recorded.get(name) != current.get(name)
    ]
    if recorded.get("packages_sha256") != current.get("packages_sha256"):
        changes.append(
            f"installed packages {recorded.get('num_packages')} -> {current.get('num_packages')} "
            f"(list sha256 {_short(recorded.get('packages_sha256'))} -> "
            f"{_short(current.get('packages_sha256'))})"
        )
    return changes


def check_stack(repeats: Repeats, current: dict) -> list[str]:
    """The stack's differences from the recorded one: StackChanged (one line naming each) unless
    the rerun allows them; then they are returned, for the log."""
    if repeats.stack is None:
        return []
    changes = stack_changes(repeats.stack, current)
    if changes and not repeats.allow_stack_change:
        raise StackChanged(
            f"the stack differs from run {repeats.run}'s: {'; '.join(changes)}: results may "
            "differ; `fab rerun --allow-stack-change` to train anyway, or run it where that "
            "stack is (its image: --runtime docker); nothing was trained"
        )
    return changes
