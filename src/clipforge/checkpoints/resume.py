"""Where a run starts: the newest checkpoint that verifies, on this disk or in the run store.

Rank 0 decides before the engine loads anything, from what is there (folders, manifests, sizes,
hashes), in one place; the other ranks then load what `latest` names. `latest` is a hint, not
the truth: missing, unreadable, naming a checkpoint that is not there or an older one, the run
resumes from the newest checkpoint that verifies and says so in one line.

- A checkpoint folder with no manifest that is newer than every finished one is a save the
  process died in: the only thing a start removes. Every other checkpoint is kept or set aside.
- Candidates are the local checkpoints with a manifest and the store's whole ones (a manifest,
  and every file it lists there with its size), newest step first, local first at equal steps
  (no download). Each is verified against its manifest (sizes and sha256; a downloaded one too).
- A damaged one (a truncated, emptied or missing file, a missing folder, a `latest` that names
  no checkpoint) is reported in one line, also sent as the `checkpoint_damaged` alert, set aside
  (renamed, never deleted, here or in the store) and the next older one is tried. A store
  checkpoint that is not whole is set aside there in any case, so that no guard counts it, and
  the uploader sends the local copy again when there is one.
- With none intact after finding damage, the stage stops with one line that says what to do,
  after setting aside the stale marker too: the rerun it suggests trains from step 0.

A store that cannot be reached is no reason not to train: the run starts from what is here.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from clipforge.checkpoints import manifest, places
from clipforge.checkpoints.checkpointer import Checkpointer
from clipforge.checkpoints.layout import (
    LATEST,
    download_name,
    is_download,
    marker_tag,
    step_of,
    tag_for,
)
from clipforge.errors import StageError
from clipforge.util import exception_summary

log = logging.getLogger(__name__)

Report = Callable[[str], None]  # one line about a damaged checkpoint (the alert logs it)


def agree_on_start(
    checkpointer: Checkpointer, stored: places.CheckpointStorage | None, report: Report
) -> None:
    """Rank 0 prepares `latest` (prepare_start) while the others wait; a stage with no intact
    checkpoint then stops on every rank, with rank 0's line."""
    error: StageError | None = None
    if checkpointer.is_main:
        try:
            prepare_start(checkpointer, stored, report)
        except StageError as exc:  # its type too: the supervisor's record names the kind
            error = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        raise error.with_traceback(None) from None


def prepare_start(
    checkpointer: Checkpointer, stored: places.CheckpointStorage | None, report: Report
) -> str | None:
    """Leave `latest` naming the newest checkpoint that verifies (fetched from `stored`, the run
    store's checkpoints, if that is where it is) and return its tag; None: start from step 0.
    StageError when checkpoints were found and none is intact."""
    run_dir, local = checkpointer.run_dir, checkpointer.storage
    damaged: list[str] = []

    def found_damaged(what: str, problem: str, aside: str | None) -> None:
        where = f"; set aside as {aside}" if aside else ""
        damaged.append(f"{what}: {problem}")
        report(f"checkpoint {what} is damaged: {problem}{where}; trying the one before it")

    for name in local.names():  # a download cut short: never verified, never used
        if is_download(name):
            local.remove(name)
    hint_text = places.marker(local)
    hint = marker_tag(hint_text) if hint_text is not None else None
    reported = hint_text is not None and hint is None  # the marker's trouble: said once
    if reported:
        assert hint_text is not None  # reported: a marker that names no tag
        found_damaged(
            str(run_dir / LATEST),
            f"it holds {hint_text.strip()[:40]!r}, not a checkpoint tag",
            str(checkpointer.set_aside(LATEST)),
        )
    finished = _local_finished(checkpointer, step_of(hint) if hint else -1, found_damaged)
    remote = _store_whole_steps(stored, found_damaged)
    hint_step = step_of(hint) if hint else None
    if hint_step is not None and hint_step not in finished and hint_step not in remote:
        if hint_step > max(finished | remote, default=-1):  # the newest checkpoint is gone
            assert hint is not None  # hint_step is its step
            found_damaged(str(run_dir / hint), "`latest` names it but it is missing", None)
            reported = True
    for step in sorted(finished | remote, reverse=True):
        tag = tag_for(step)
        if step in finished:
            problem = manifest.problem(run_dir / tag)
            if problem is None:
                return _start_from(checkpointer, tag, hint_text, reported)
            found_damaged(str(run_dir / tag), problem, str(checkpointer.set_aside(tag)))
        if step in remote and stored is not None and _fetch(stored, tag, run_dir, found_damaged):
            return _start_from(checkpointer, tag, hint_text, reported)
    if damaged:
        if local.exists(LATEST):  # stale: what it named is set aside or gone
            checkpointer.set_aside(LATEST)
        raise StageError(
            f"no intact checkpoint of {run_dir.name} to resume from ({'; '.join(damaged)}); the "
            f"damaged ones are set aside under {run_dir}: rerun the stage to train from step 0, "
            f"or put an intact checkpoint back there first"
        )
    return None


def _local_finished(checkpointer: Checkpointer, hint_step: int, found_damaged) -> set[int]:
    """Steps of the local checkpoints whose save finished (a manifest is there). A folder with
    none, newer than every finished one and than `latest`, is a save the process died in: it is
    removed. One with none below a finished one lost its manifest: set aside."""
    run_dir, local = checkpointer.run_dir, checkpointer.storage
    tags = checkpointer.tags()
    finished = {step_of(t) for t in tags if places.has_manifest(local, t)}
    newest = max(finished | {hint_step}, default=-1)
    for tag in tags:
        step = step_of(tag)
        if step in finished:
            continue
        if step > newest:
            log.info("removing %s: a save that never finished (no manifest)", run_dir / tag)
            local.remove(tag)
        else:
            problem = "it has no manifest, although a later save finished"
            found_damaged(str(run_dir / tag), problem, str(checkpointer.set_aside(tag)))
    return finished


def _store_whole_steps(stored: places.CheckpointStorage | None, found_damaged) -> set[int]:
    """Steps of the store's whole checkpoints. One with a manifest that is not whole (an object
    missing or of another size) is set aside there; one without a manifest is an upload under
    way or cut short, which the uploader replaces."""
    if stored is None:
        return set()
    try:
        whole: set[int] = set()
        for tag in places.tags(stored):
            if not places.has_manifest(stored, tag):
                continue
            problem = places.not_whole(stored, tag)
            if problem is None:
                whole.add(step_of(tag))
            else:
                found_damaged(f"{stored.where}/{tag}", problem, places.set_aside(stored, tag))
        return whole
    except Exception as exc:  # an unreachable store must not stop the run: what is here will do
        log.warning(
            "run store %s not reachable (%s): starting from what is on this disk",
            stored.where,
            exception_summary(exc),
        )
        return set()


def _fetch(stored: places.CheckpointStorage, tag: str, run_dir: Path, found_damaged) -> bool:
    """Download the store's `tag` into the run directory and verify it; False when it is damaged
    (set aside in the store) or could not be downloaded."""
    staging = run_dir / download_name(tag)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        log.info("fetching %s from the run store %s", tag, stored.where)
        places.fetch(stored, tag, staging)
        problem = manifest.problem(staging)
        if problem is None:
            staging.rename(run_dir / tag)
            return True
        found_damaged(f"{stored.where}/{tag}", problem, places.set_aside(stored, tag))
    except Exception as exc:  # a store gone mid-download: try an older one, or what is here
        log.warning(
            "could not fetch %s from the run store %s: %s",
            tag,
            stored.where,
            exception_summary(exc),
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return False


def _start_from(checkpointer: Checkpointer, tag: str, hint_text: str | None, reported: bool) -> str:
    """Publish `tag`; one line when `latest` did not name it (unless its trouble was reported)."""
    hint = marker_tag(hint_text) if hint_text is not None else None
    if hint != tag and not reported:
        said = (
            "no `latest`"
            if hint_text is None
            else f"`latest` names {hint}"
            if hint
            else "an unreadable `latest`"
        )
        log.warning(
            "%s: %s; resuming from %s, the newest checkpoint that verifies",
            checkpointer.run_dir,
            said,
            tag,
        )
    if hint != tag:
        checkpointer.publish(tag)
    return tag
