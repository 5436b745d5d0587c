"""A stage's deterministic fault, as a typed record its supervisor reads: no restart can fix it.

A stage under the launcher's supervisor runs behind DVC (`dvc exp run`), which exits with codes
of its own whatever the stage's, so the exit code cannot say why the stage ended. The record can:
the supervisor names a file in CLIPFORGE_FAULT_RECORD (NODE_DIR/fault.json, inside the run
directory that a container mounts at the same path), removes it before each attempt, and after
an attempt that failed reads it. A stage that ends on a user error (clipforge.errors.UserError,
one line and exit 2) writes its kind, its line and the run's last step there when it knows
it. Every kind (a full disk, a permission, a refused input, a software stack that cannot run the
stage) repeats the same way on a restart: the supervisor gives up at once, with the line as its
reason, and spends no restart. A user error whose `fault` is None (a lock held by a trainer that
may end) writes nothing, and is restarted as any crash is.

Standard library only: the supervisor reads it with the host's python3.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from clipforge.errors import UserError
from clipforge.fsutil import atomic_write_text

FAULT_RECORD_ENV = "CLIPFORGE_FAULT_RECORD"
KINDS = ("disk_full", "permission", "input", "stack")


@dataclass(frozen=True)
class StageFault:
    kind: str
    """One of KINDS."""
    cause: str
    """The stage's own line: what is wrong and what to do."""
    step: int | None = None
    """The run's last step when it stopped, where the stage knew it."""
    at: float = 0.0


def record_fault(error: UserError, environ: Mapping[str, str] = os.environ) -> None:
    """Write `error` as the stage's fault, when a supervisor asked for one and a restart would
    meet it again. Never raises: the stage is ending on its own line anyway."""
    path = environ.get(FAULT_RECORD_ENV)
    if not path or error.fault is None:
        return
    cause = " ".join(str(error).split()) or type(error).__name__  # one line, whatever it held
    fault = StageFault(error.fault, cause, error.step, time.time())
    try:
        atomic_write_text(path, json.dumps(asdict(fault)) + "\n")
    except OSError:  # the node folder full or read-only too: the supervisor restarts as before
        pass


def read_fault(path: str | Path) -> StageFault | None:
    """The fault a stage recorded at `path`; None when there is none or it is not one (a record
    that cannot be read never stops a run that a restart might save)."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        kind, cause, step = raw["kind"], raw["cause"], raw.get("step")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if kind not in KINDS or not isinstance(cause, str):
        return None
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    at = raw.get("at") if isinstance(raw.get("at"), (int, float)) else 0.0
    return StageFault(kind, cause, step, float(at))


def clear_fault(path: str | Path) -> None:
    """Before an attempt: a record is only ever about the attempt that wrote it."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
