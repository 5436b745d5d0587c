"""Where a run starts: the newest intact checkpoint, on this disk or in the run store.

Rank 0 decides before the engine loads anything; the other ranks then load what `latest` names.
The candidates are the local checkpoints up to what `latest` names and the store's complete ones
up to what its own `latest` names, newest step first (local first at equal steps: no download).
Each is verified against its manifest (a downloaded one too) before it is used. A damaged one
(a truncated, emptied or missing file, a missing folder, a `latest` that names no checkpoint)
is reported in one line, also sent as the `checkpoint_damaged` alert, set aside (renamed, never
deleted, here or in the store) and the next older one is tried. With none intact, the stage
stops with one line that says what to do.

A store that cannot be reached is no reason not to train: the run starts from what is here.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from clipforge.cli import StageError
from clipforge.store import manifest
from clipforge.store.remote import LATEST, RunStore, tag_step
from clipforge.train.checkpoint import Checkpointer, tag_for

log = logging.getLogger("clipforge.train")

Report = Callable[[str], None]  # one line about a damaged checkpoint (the alert logs it)


def agree_on_start(checkpointer: Checkpointer, store: RunStore | None, report: Report) -> None:
    """Rank 0 prepares `latest` (prepare_start) while the others wait; a stage with no intact
    checkpoint then stops on every rank, with rank 0's line."""
    error = None
    if checkpointer.is_main:
        try:
            prepare_start(checkpointer, store, report)
        except StageError as exc:
            error = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        raise StageError(error)


def prepare_start(checkpointer: Checkpointer, store: RunStore | None, report: Report) -> str | None:
    """Leave `latest` naming the newest intact checkpoint (fetched from the store if that is
    where it is) and return its tag; None: start from step 0. StageError when checkpoints were
    found and none is intact."""
    run_dir = checkpointer.run_dir
    damaged: list[str] = []

    def found_damaged(what: str, problem: str, aside: str | None) -> None:
        where = f"; set aside as {aside}" if aside else ""
        damaged.append(f"{what}: {problem}")
        report(f"checkpoint {what} is damaged: {problem}{where}; trying the one before it")

    marker_step = _local_marker_step(checkpointer, found_damaged)
    if marker_step is not None:
        checkpointer.discard_incomplete()
    local = {tag_step(t) for t in checkpointer.tags()}
    if marker_step is not None:
        local = {s for s in local if s <= marker_step}
        if marker_step not in local:
            found_damaged(
                str(run_dir / tag_for(marker_step)), "`latest` names it but it is missing", None
            )
    remote = set(_store_steps(store))
    for step in sorted(local | remote, reverse=True):
        tag = tag_for(step)
        if step in local:
            problem = manifest.problem(run_dir / tag)
            if problem is None:
                return _start_from(checkpointer, tag)
            found_damaged(str(run_dir / tag), problem, str(checkpointer.set_aside(tag)))
        if step in remote and _fetch(store, tag, run_dir, found_damaged):
            return _start_from(checkpointer, tag)
    if damaged:
        raise StageError(
            f"no intact checkpoint of {run_dir.name} to resume from ({'; '.join(damaged)}); the "
            f"damaged ones are set aside under {run_dir}: rerun the stage to train from step 0, "
            f"or put an intact checkpoint back there first"
        )
    return None


def _local_marker_step(checkpointer: Checkpointer, found_damaged) -> int | None:
    tag = checkpointer.latest_tag()
    if tag is None:
        return None
    step = tag_step(tag)
    if step is None:
        aside = checkpointer.set_aside(LATEST)
        found_damaged(
            str(checkpointer.run_dir / LATEST),
            f"it holds {tag[:40]!r}, not a checkpoint tag",
            str(aside),
        )
    return step


def _store_steps(store: RunStore | None) -> list[int]:
    if store is None:
        return []
    try:
        return store.complete_steps()
    except Exception as exc:  # an unreachable store must not stop the run: what is here will do
        log.warning(
            "run store %s not reachable (%s): starting from what is on this disk",
            store.url,
            _brief(exc),
        )
        return []


def _fetch(store: RunStore, tag: str, run_dir: Path, found_damaged) -> bool:
    """Download the store's `tag` into the run directory and verify it; False when it is damaged
    (set aside in the store) or could not be downloaded."""
    staging = run_dir / f".download-{tag}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        log.info("fetching %s from the run store %s", tag, store.url)
        store.download_checkpoint(tag, staging)
        problem = manifest.problem(staging)
        if problem is None:
            staging.rename(run_dir / tag)
            return True
        found_damaged(f"{store.url}/checkpoints/{tag}", problem, store.set_aside(tag))
    except Exception as exc:  # a store gone mid-download: try an older one, or what is here
        log.warning("could not fetch %s from the run store %s: %s", tag, store.url, _brief(exc))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return False


def _start_from(checkpointer: Checkpointer, tag: str) -> str:
    if checkpointer.latest_tag() != tag:
        checkpointer.publish(tag)
    return tag


def _brief(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
