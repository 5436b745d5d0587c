"""The supervisor's state (NODE_DIR/state.json): one typed record, one writer, one reader.

It crosses processes and machines: the supervisor writes it, `fab status` (host side, then the
laptop), `fab train` (waiting for the start, `--resume`) and the laptop's watch read it. So it is a
typed record with a `RunState` enum rather than a dict whose "state" string is compared in five
places, and `parse_state` is the one reader: a damaged file is an error that says what is
wrong with it (which field, what it holds), not a KeyError somewhere later. Standard library
only (it runs on the host, see clipforge.launcher.host).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clipforge.errors import UserError
from clipforge.util import read_record_file, record_json, typed_fields


class RunState(str, enum.Enum):
    """Where a node's supervisor is. A str, so that its JSON form is the plain name."""

    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"  # waiting before a restart
    STOPPING = "stopping"  # a stop was requested; the phase is checkpointing
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"
    LOST = "lost"
    """Never written: a reader's verdict on a non-terminal state whose supervisor is gone."""

    @property
    def terminal(self) -> bool:
        return self in (RunState.FINISHED, RunState.STOPPED, RunState.FAILED)

    @property
    def started(self) -> bool:
        """The supervisor got going (what `fab train` waits for before it returns)."""
        return self in (RunState.STARTING, RunState.RUNNING, RunState.BACKOFF, RunState.FINISHED)

    def __str__(self) -> str:
        return self.value


TERMINAL_STATES = tuple(s for s in RunState if s.terminal)


class StateFileError(UserError, ValueError):
    """state.json exists but is not a supervisor state; the message says what is wrong."""


@dataclass(frozen=True)
class SupervisorState:
    state: RunState
    started_at: float
    max_restarts: int
    supervisor_pid: int | None = None
    restarts: int = 0
    phase: str | None = None
    attempt: int = 0
    child_pid: int | None = None
    attempt_started_at: float | None = None
    finished_at: float | None = None
    updated_at: float | None = None
    reason: str | None = None
    """Why the supervisor gave up (state failed)."""
    exits: list[dict] = field(default_factory=list)
    """Abnormal exits, newest last: phase, attempt, code, at (and `hang` when it hung)."""
    passed_env: list[str] = field(default_factory=list)
    """Names (never values) of the secrets passed through to the run."""
    gpus: dict | None = None
    """The GPUs the last attempt ran on and those found gone (see gpu_lost), when known."""
    last_step: int | None = None
    """The run's last step when it failed, as its stage recorded it (clipforge.fault_record)."""

    def to_dict(self) -> dict:
        raw = dataclasses.asdict(self)
        raw["state"] = self.state.value
        return raw

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


_REQUIRED = ("state", "started_at", "max_restarts")
_TYPES: dict[str, type | tuple[type, ...]] = {
    "supervisor_pid": (int, type(None)),
    "started_at": (int, float),
    "max_restarts": int,
    "restarts": int,
    "phase": (str, type(None)),
    "attempt": int,
    "child_pid": (int, type(None)),
    "attempt_started_at": (int, float, type(None)),
    "finished_at": (int, float, type(None)),
    "updated_at": (int, float, type(None)),
    "reason": (str, type(None)),
    "exits": list,
    "passed_env": list,
    "gpus": (dict, type(None)),
    "last_step": (int, type(None)),
}


def state_from_dict(raw: object, source: str = "state.json") -> SupervisorState:
    """The one reader: a dict (parsed JSON) to a SupervisorState, or StateFileError naming
    the source and the field at fault. Unknown keys (a newer supervisor's) are ignored."""
    if not isinstance(raw, dict):
        raise StateFileError(f"{source}: not a JSON object but {type(raw).__name__}")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise StateFileError(f"{source}: missing {', '.join(missing)}")
    try:
        state = RunState(raw["state"])
    except ValueError:
        allowed = ", ".join(s.value for s in RunState)
        raise StateFileError(f"{source}: state is {raw['state']!r}, not one of {allowed}") from None
    values: dict[str, Any] = {"state": state, **typed_fields(raw, _TYPES, source, StateFileError)}
    return SupervisorState(**values)


def parse_state(text: str, source: str = "state.json") -> SupervisorState:
    return state_from_dict(record_json(text, source, StateFileError), source)


def read_state(path: str | Path) -> SupervisorState | None:
    """The state at `path`; None when there is none yet; StateFileError when it is damaged."""
    return read_record_file(path, parse_state)
