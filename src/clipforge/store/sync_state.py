"""The run store's sync state: one typed record, one writer, one reader.

The uploader (clipforge.store.uploader) writes it beside the run's checkpoints
(checkpoints/run-<id>/sync.json) and into the store (<remote>/<run id>/status.json). It crosses
processes and machines: `fab status` reads it on the host and shows it on the laptop, `fab status
--launch ID` reads the store's copy from the laptop. So it is a frozen dataclass with a `SyncPhase`
enum rather than a dict read by key, and `sync_state_from_dict` is the one reader: a damaged file
is an error naming the file and the field at fault. Standard library only: the host side reads it
(clipforge.launcher.host.status), where nothing but the checkout may be importable.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clipforge.errors import UserError
from clipforge.util import read_record_file, record_json, typed_fields

SYNC_STATE_FILE = "sync.json"  # beside the checkpoints of the run
STORE_STATUS_FILE = "status.json"  # in the run's place in the store


class SyncPhase(str, enum.Enum):
    """Where the training run is, as its uploader saw it. A str: its JSON form is the name."""

    TRAINING = "training"
    # the train stage's outcome, given to the uploader's last pass
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class SyncStateError(UserError, ValueError):
    """A sync state file exists but is not one; the message says what is wrong."""


@dataclass(frozen=True, kw_only=True)
class SyncState:
    run_id: str
    launch_id: str | None
    """None: a run not started by `fab train` (clipforge.ids: the two ids)."""
    state: SyncPhase
    host: str
    """The host the training runs on."""
    updated_at: float
    """Unix time of the write."""
    store: str
    """The run's place in the store (its URL)."""
    store_step: int | None
    """The store's newest whole checkpoint's step (None: none known yet)."""
    lag_steps: int
    """Newest local checkpoint's step minus the store's newest."""
    lag_seconds: float
    """How long the oldest checkpoint not in the store has waited (0: none waits)."""
    failures: int
    """Failed passes in a row."""
    last_error: str | None

    def to_dict(self) -> dict:
        raw = dataclasses.asdict(self)
        raw["state"] = self.state.value
        return raw

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


_NUMBER = (int, float)
_TYPES: dict[str, tuple[type, ...]] = {
    "run_id": (str,),
    "launch_id": (str, type(None)),
    "host": (str,),
    "updated_at": _NUMBER,
    "store": (str,),
    "store_step": (int, type(None)),
    "lag_steps": (int,),
    "lag_seconds": _NUMBER,
    "failures": (int,),
    "last_error": (str, type(None)),
}


def sync_state_from_dict(raw: object, source: str = SYNC_STATE_FILE) -> SyncState:
    """The one reader: a dict (parsed JSON) to a SyncState, or SyncStateError naming the source
    and the field at fault. Unknown keys (a newer uploader's) are ignored."""
    if not isinstance(raw, dict):
        raise SyncStateError(f"{source}: not a JSON object but {type(raw).__name__}")
    missing = [key for key in ("state", *_TYPES) if key not in raw]
    if missing:
        raise SyncStateError(f"{source}: not a sync state, missing {', '.join(missing)}")
    try:
        state = SyncPhase(raw["state"])
    except ValueError:
        allowed = ", ".join(p.value for p in SyncPhase)
        raise SyncStateError(f"{source}: state is {raw['state']!r}, not one of {allowed}") from None
    values: dict[str, Any] = {"state": state, **typed_fields(raw, _TYPES, source, SyncStateError)}
    return SyncState(**values)


def parse_sync_state(text: str | bytes, source: str = SYNC_STATE_FILE) -> SyncState:
    return sync_state_from_dict(record_json(text, source, SyncStateError), source)


def read_sync_state(path: str | Path) -> SyncState | None:
    """The state at `path`; None when there is none yet; SyncStateError when it is damaged."""
    return read_record_file(path, parse_sync_state)
