"""The two ids of a training run, each with one constructor.

- launch id, `YYYYMMDD-HHMMSS-<commit[:8]>`: one `fab train`, named by the launcher when it
  starts the run (UTC time, commit of the code it ships). It names the run's directory on a host
  (`<root>/runs/<launch id>`), its run record (run.json) and its record in the run store.
- run id, `run-<sha256[:12]>`: the training run, named by the train stage from what determines
  its result (data manifest, model and train params). It names the checkpoints directory
  (`checkpoints/<run id>`), the run store's folder of the run, and every metrics row; a resumed
  or relaunched run keeps it, so several launches can share one run id.

Both go into every alert, run record and status line that knows them, each under its own name
(docs/alerts.md). Standard library only: the GPU host side uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping

RUN_ID = re.compile(r"run-[0-9a-f]{12}")


def new_launch_id(commit: str, now: float | None = None) -> str:
    """The id of a launch of `commit` starting `now` (Unix time; default: the current time)."""
    started = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{started}-{commit[:8]}"


def run_id_for(fingerprint: Mapping) -> str:
    """The run id of a training run whose result `fingerprint` (JSON-able) determines."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    return f"run-{digest[:12]}"


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
