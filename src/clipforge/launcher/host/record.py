"""The run record (<root>/runs/<launch id>/run.json): one typed record, one writer, one reader.

`fab train` writes it on every node before the supervisor starts (clipforge.launcher.launch), and
it crosses processes and machines from there: the host side reads it (`fab status`, the
supervisor's GPU count, the checkpoints `make down` checks), the laptop reads it over SSH (`fab
fetch`, `fab tensorboard`, `fab train --resume`), and the train stage copies it verbatim to the
run store (launches/<launch id>.json), where `fab train --resume` on new hosts reads it back. So
it is a frozen dataclass rather than a dict read by key in eight places, and `record_from_dict` is
the one reader: a damaged file is an error naming the file and the field at fault, not a KeyError
later. Standard library only (it runs on the host, see clipforge.launcher.host).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clipforge.errors import UserError
from clipforge.util import read_record_file, record_json, typed_fields


class RunRecordError(UserError, ValueError):
    """run.json (or the store's copy) exists but is not a run record; the message says why."""


@dataclass(frozen=True)
class SocketInterface:
    """The interface a node's ranks talk on (GLOO/NCCL_SOCKET_IFNAME), and why that one."""

    interface: str
    address: str
    chosen_by: str


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    launch_id: str
    """clipforge.ids' launch id; the training run's id is the stage's (run-<sha12>)."""
    commit: str
    dirty_paths_not_shipped: tuple[str, ...]
    created_at: str
    """UTC, ISO 8601 to the second."""
    launched_by: str
    hosts: tuple[str, ...]
    """Every node's host, node rank order."""
    host: str
    """Node 0's."""
    num_nodes: int
    gpus_per_node: int
    """0: CPU ranks."""
    runtime: str
    image: str
    container_user: str | None = None
    """The docker runtime's uid:gid in the container (None: the host runtime)."""
    data: str
    smoke: bool
    executor: str
    overrides: tuple[str, ...]
    """The launch's --set items, as given."""
    params: dict
    """The resolved params.yaml the run trains on."""
    checkpoints_dir: str
    master: str | None
    """host:port of the rendezvous (several nodes only)."""
    allow_public_master: bool = False
    """fab train --allow-public-master: the rendezvous may listen on a public address."""
    socket_interfaces: tuple[SocketInterface, ...] | None = None
    """Per node rank (several nodes only)."""
    max_restarts: int
    min_gpus: int | None = None
    """fab train --min-gpus: the fewest GPUs per node the run goes on with (None: half)."""
    env_passed_through: tuple[str, ...]
    """Names (never values) of the secrets passed to the run."""
    environment: dict | None = None
    """The launching side's environment record (clipforge.envrecord): the commit shipped, the
    params' hash, the image; the stack that trained is in train.info.json's."""
    repeats: dict | None = None
    """`fab rerun`: the run this launch repeats, its data manifest and stack (clipforge.repeats,
    its one reader); None for any other launch."""

    @property
    def store_remote(self) -> str | None:
        """The run store of the run's params (storage.remote), if any: its one reader."""
        storage = self.params.get("storage")
        remote = storage.get("remote") if isinstance(storage, dict) else None
        return remote if isinstance(remote, str) and remote else None

    def to_dict(self) -> dict:
        raw = dataclasses.asdict(self)
        for key, value in raw.items():
            if isinstance(value, tuple):
                raw[key] = list(value)
        return raw

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


_STR = (str,)
_OPTIONAL_STR = (str, type(None))
# Each field's JSON types; a list of strings is checked item by item.
_TYPES: dict[str, tuple[type, ...]] = {
    "launch_id": _STR,
    "commit": _STR,
    "dirty_paths_not_shipped": (list,),
    "created_at": _STR,
    "launched_by": _STR,
    "hosts": (list,),
    "host": _STR,
    "num_nodes": (int,),
    "gpus_per_node": (int,),
    "runtime": _STR,
    "image": _STR,
    "container_user": _OPTIONAL_STR,
    "data": _STR,
    "smoke": (bool,),
    "executor": _STR,
    "overrides": (list,),
    "params": (dict,),
    "checkpoints_dir": _STR,
    "master": _OPTIONAL_STR,
    "allow_public_master": (bool,),
    "socket_interfaces": (list, type(None)),
    "max_restarts": (int,),
    "min_gpus": (int, type(None)),
    "env_passed_through": (list,),
    "environment": (dict, type(None)),
    "repeats": (dict, type(None)),
}
_STRING_LISTS = ("dirty_paths_not_shipped", "hosts", "overrides", "env_passed_through")
_OPTIONAL = {
    field.name
    for field in dataclasses.fields(RunRecord)
    if field.default is not dataclasses.MISSING
}


def record_from_dict(raw: object, source: str = "run.json") -> RunRecord:
    """The one reader: a dict (parsed JSON) to a RunRecord, or RunRecordError naming the source
    and the field at fault. Unknown keys (a newer launcher's) are ignored."""
    if not isinstance(raw, dict):
        raise RunRecordError(f"{source}: not a JSON object but {type(raw).__name__}")
    missing = [key for key in _TYPES if key not in raw and key not in _OPTIONAL]
    if missing:
        raise RunRecordError(f"{source}: not a run record, missing {', '.join(missing)}")
    values: dict[str, Any] = typed_fields(raw, _TYPES, source, RunRecordError)
    for key in _STRING_LISTS:
        if isinstance(values.get(key), list):
            if not all(isinstance(item, str) for item in values[key]):
                raise RunRecordError(f"{source}: {key} is {values[key]!r}, not a list of strings")
            values[key] = tuple(values[key])
    if values.get("socket_interfaces") is not None:
        values["socket_interfaces"] = tuple(
            _interface(item, source) for item in values["socket_interfaces"]
        )
    return RunRecord(**values)


def _interface(raw: object, source: str) -> SocketInterface:
    names = [field.name for field in dataclasses.fields(SocketInterface)]
    if not isinstance(raw, dict) or not all(isinstance(raw.get(name), str) for name in names):
        raise RunRecordError(
            f"{source}: socket_interfaces holds {raw!r}, not an object of {', '.join(names)}"
        )
    return SocketInterface(**{name: raw[name] for name in names})


def parse_record(text: str, source: str = "run.json") -> RunRecord:
    return record_from_dict(record_json(text, source, RunRecordError), source)


def read_record(path: str | Path) -> RunRecord | None:
    """The record at `path`; None when there is none; RunRecordError when it is damaged."""
    return read_record_file(path, parse_record)
