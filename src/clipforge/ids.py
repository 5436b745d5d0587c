"""The two ids of a training run, each with one constructor.

- launch id, `YYYYMMDD-HHMMSS-<commit[:8]>`: one `fab train`, named by the launcher when it
  starts the run (UTC time, commit of the code it ships). It names the run's directory on a host
  (`<root>/runs/<launch id>`), its run record (run.json) and its record in the run store.
- run id, `run-<sha256[:12]>`: the training run, named by the train stage from what determines
  its result (data manifest, model and train params). It names the checkpoints directory
  (`checkpoints/<run id>`), the run store's folder of the run, and every metrics row; a resumed
  or relaunched run keeps it, so several launches can share one run id.

Both go into every alert, run record and status line that knows them, each under its own name
(docs/alerts.md). Both name folders, so an id that comes from outside (a `--launch` argument, a
host's `current` marker, a run store's record) is parsed where it enters: `../../victim` is no
launch id, and the one-line error says where it came from (IdError). Standard library only: the
GPU host side uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from typing import NamedTuple

from clipforge.errors import UserError
from clipforge.util import short_repr

# ASCII digits: `\d` would take any script's digits.
LAUNCH_ID = re.compile(r"(?P<started>[0-9]{8}-[0-9]{6})-(?P<commit>[0-9a-f]{1,40})")
RUN_ID = re.compile(r"run-(?P<digest>[0-9a-f]{12})")


class IdError(UserError, ValueError):
    """Text that should be a launch id or a run id and is not; the message says where it came
    from and what an id looks like."""


class LaunchId(NamedTuple):
    started: str  # YYYYMMDD-HHMMSS, UTC
    commit: str  # the first 8 hex digits of the commit the launch shipped


def new_launch_id(commit: str, now: float | None = None) -> str:
    """The id of a launch of `commit` starting `now` (Unix time; default: the current time)."""
    started = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{started}-{commit[:8]}"


def parse_launch_id(text: object, source: str | None = None) -> LaunchId:
    """The parts of a launch id; IdError naming `source` (where the text came from) and the
    expected form otherwise."""
    match = LAUNCH_ID.fullmatch(text) if isinstance(text, str) else None
    if not match:
        where = f"{source}: " if source else ""
        raise IdError(
            f"{where}not a launch id: {short_repr(text)} (expected YYYYMMDD-HHMMSS-<commit>)"
        )
    return LaunchId(match["started"], match["commit"])


def checked_launch_id(text: object, source: str) -> str:
    """`text`, once it is a launch id (parse_launch_id); for ids from outside."""
    parse_launch_id(text, source)
    return str(text)


def run_id_for(fingerprint: Mapping) -> str:
    """The run id of a training run whose result `fingerprint` (JSON-able) determines."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    return f"run-{digest[:12]}"


def parse_run_id(text: object, source: str | None = None) -> str:
    """The digest part of a run id; IdError naming `source` and the expected form otherwise."""
    match = RUN_ID.fullmatch(text) if isinstance(text, str) else None
    if not match:
        where = f"{source}: " if source else ""
        raise IdError(f"{where}not a run id: {short_repr(text)} (expected run-<12 hex digits>)")
    return match["digest"]


def is_launch_id(text: str) -> bool:
    return LAUNCH_ID.fullmatch(text) is not None


def is_run_id(text: str) -> bool:
    return RUN_ID.fullmatch(text) is not None


def run_ids_in(checkpoints_dir: str | os.PathLike) -> list[str]:
    """The run ids a checkpoints directory holds runs of (its `run-<digest>` folders), sorted."""
    try:
        names = os.listdir(checkpoints_dir)
    except OSError:
        return []
    return sorted(
        n for n in names if is_run_id(n) and os.path.isdir(os.path.join(checkpoints_dir, n))
    )


def launch_id_of(record: dict) -> str | None:
    """The launch id a run record (run.json, as parsed JSON) names; None when it names none."""
    value = record.get("launch_id")
    return value if isinstance(value, str) else None
