"""The run store's uploader: a thread of rank 0 that copies the run to `storage.remote`.

The training thread only says that a checkpoint was saved (a put on a bounded queue that never
waits: a full queue loses nothing, since each pass looks at the disk) and, at the end, asks for
a last pass. Each pass uploads, in this order:
- every local checkpoint newer than the store's newest, oldest first: its files, its manifest,
  then the store's `latest` (clipforge.store.remote); then the store keeps its
  `storage.keep_checkpoints` newest;
- after a checkpoint, every `storage.sync_logs_every_minutes` and at the end: the run's
  TensorBoard events, metrics/train.tsv and val.tsv, its record and status;
- at the end: metrics/train.json, train.info.json and the exported model.

A pass that fails (a full or unreachable store) is retried after a back-off, doubling up to
`storage.max_retry_backoff_seconds`, for as long as the run lasts; the checkpoints wait on the
local disk meanwhile (the checkpointer prunes none the store has not taken). After
`storage.failures_before_alert` failures in a row: the `store_unreachable` alert; a checkpoint
waiting longer than `storage.max_lag_seconds`: `store_sync_lag`; all caught up after either:
`store_caught_up`. The lag (steps and seconds) goes to TensorBoard at each save, and with the
rest of the sync's state to `sync.json` beside the checkpoints, which `fab status` and `make
down`'s guard read.

What the store holds is what it holds whole (clipforge.checkpoints.places.not_whole), learnt
when the uploader starts and again after a failed pass: a checkpoint the start of the run found
not whole there (and set aside) is uploaded again from the local copy. The uploader also keeps
the run's lease in the store (clipforge.store.lease): refreshed every minute, checked before
each checkpoint goes up; lost to another trainer, it uploads nothing more and the training stops
at its next save.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clipforge.alerts.monitor import AlertMonitor
from clipforge.checkpoints.checkpointer import Checkpointer
from clipforge.checkpoints.layout import CHECKPOINT_MANIFEST, step_of, tag_for, tag_step
from clipforge.checkpoints.lock import Holder
from clipforge.fsutil import atomic_write_text
from clipforge.ids import launch_id_of
from clipforge.store.config import StorageConfig
from clipforge.store.lease import (
    LEASE_HEARTBEAT_SECONDS,
    LeaseLost,
    check_lease,
    release_lease,
    renew_lease,
    take_lease,
)
from clipforge.store.remote import RUN_RECORD_ENV, RunStore
from clipforge.store.sync_state import STORE_STATUS_FILE, SYNC_STATE_FILE, SyncPhase, SyncState
from clipforge.util import backoff_seconds, exception_summary

log = logging.getLogger(__name__)

_WAKE_QUEUE_SIZE = 8  # a request is a wake-up: more than a few pending say nothing more
_POLL_SECONDS = 1.0  # how often an idle uploader looks at the clock (logs due, lag)


@dataclass(frozen=True)
class Lag:
    steps: int  # newest local checkpoint's step - the store's newest
    seconds: float  # how long the oldest checkpoint not in the store has waited (0: none)


# A local file or folder, and where it goes in the store (relative to the run's place there).
Mirrored = tuple[Path, str]
# Called with a checkpoint's step once its first file is uploaded: a fault hook
# (clipforge.train.faults' hold_upload), so a test can kill the process mid-upload.
AfterFirstFile = Callable[[int], None]


class StoreSync:
    def __init__(
        self,
        store: RunStore,
        checkpointer: Checkpointer,
        config: StorageConfig,
        alerts: AlertMonitor,
        logs: list[Mirrored],
        record: dict,
        after_first_file: AfterFirstFile = lambda step: None,
        clock=time.monotonic,
        holder: Holder | None = None,
        lease_taken: bool = False,
    ):
        self.store = store
        self.checkpointer = checkpointer
        self.config = config
        self.alerts = alerts
        self.logs = logs
        self.record = record
        self.after_first_file = after_first_file
        self.clock = clock
        self.synced_step: int | None = None  # the store's newest whole one (None: none known)
        self._store_known = False  # whether synced_step is what the store answered
        self.holder = holder  # the lease's holder: this trainer (None: no lease kept)
        self._lease_taken = lease_taken
        self._lease_due_at = 0.0
        self.lost: LeaseLost | None = None  # the lease, taken by another trainer
        self.state = SyncPhase.TRAINING
        self._lock = threading.Lock()  # _saved_at: written by both threads
        self._saved_at: dict[int, float] = {}  # local checkpoints not yet in the store
        self._uploaded: dict[Path, tuple[int, int]] = {}  # file -> (size, mtime) uploaded
        self._requests: queue.Queue = queue.Queue(_WAKE_QUEUE_SIZE)
        self._logs_due_at = 0.0
        self._final: list[Mirrored] | None = None
        self._final_done = threading.Event()
        self._stopping = False
        self._failures = 0
        self._last_error = ""
        self._lag_alerted = self._unreachable_alerted = False
        self._thread = threading.Thread(target=self._run, name="run-store-sync", daemon=True)
        checkpointer.needed_elsewhere = self.needs_upload

    # -- what the training thread calls --------------------------------------------------------
    def start(self) -> StoreSync:
        now = self.clock()
        with self._lock:
            for tag in self._published_tags():  # left by an earlier attempt: due since now
                self._saved_at.setdefault(step_of(tag), now)
        self._thread.start()
        return self

    def checkpoint_saved(self, step: int) -> Lag:
        """LeaseLost when another trainer has taken the run over in the store."""
        if self.lost is not None:
            raise self.lost
        with self._lock:
            self._saved_at.setdefault(step, self.clock())
        self._logs_due_at = 0.0
        self._wake()
        return self.lag()

    def needs_upload(self, tag: str) -> bool:
        """True while the store lacks this checkpoint and has nothing newer: keep it locally."""
        return self._needs_upload(step_of(tag))

    def lag(self) -> Lag:
        with self._lock:
            waiting = {step: at for step, at in self._saved_at.items() if self._needs_upload(step)}
        synced = self.synced_step or 0
        return Lag(
            steps=max(0, max(waiting, default=synced) - synced),
            seconds=self.clock() - min(waiting.values()) if waiting else 0.0,
        )

    def _needs_upload(self, step: int) -> bool:
        synced = self.synced_step
        return not self._store_known or synced is None or step > synced

    def finish(self, state: SyncPhase | str, final: list[Mirrored]) -> None:
        """A last pass (the final checkpoint, logs, `final`), waited for up to
        storage.flush_timeout_seconds; then the uploader stops. `state`: the stage's outcome."""
        self.state = SyncPhase(state)
        self._final = final
        self._wake()
        if not self._final_done.is_set() and self.lost is None:
            # made visible: a failing store would otherwise hold the end of the run silently
            log.log(
                logging.WARNING if self._failures else logging.INFO,
                "run store %s: waiting up to %gs (storage.flush_timeout_seconds) for the last "
                "uploads%s; Ctrl-C leaves them on this disk for the next start",
                self.store.url,
                self.config.flush_timeout_seconds,
                f" (failing: {self._last_error})" if self._last_error else "",
            )
        try:
            done = self.lost is not None or self._final_done.wait(self.config.flush_timeout_seconds)
        except KeyboardInterrupt:
            done = False
        if not done:
            log.warning(
                "run store %s: not everything uploaded after %gs (%d checkpoint(s) waiting%s); "
                "they stay in %s, and the next start of the stage uploads them",
                self.store.url,
                self.config.flush_timeout_seconds,
                len(self._waiting()),
                f"; last error: {self._last_error}" if self._last_error else "",
                self.checkpointer.run_dir,
            )
        self._stopping = True
        self._wake()
        # The uploader is a daemon thread: the process may exit before its own last write of
        # sync.json. Once it is done (or stuck on an unanswering store), this thread writes it.
        self._thread.join(timeout=_POLL_SECONDS)
        self._write_status()
        self.checkpointer.prune()  # what the store now holds need not stay here beyond `keep`
        if self.holder is not None and self.lost is None and not self._thread.is_alive():
            try:
                release_lease(self.store, self.holder)
            except Exception as exc:  # a store gone: the lease simply stops beating
                log.debug("run store %s: lease not released (%s)", self.store.url, exc)

    def _wake(self) -> None:
        try:
            self._requests.put_nowait(None)
        except queue.Full:
            pass

    # -- the uploader thread -------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.0
        while not self._stopping:
            try:
                self._requests.get(timeout=backoff or _POLL_SECONDS)
            except queue.Empty:
                pass
            if self._stopping:
                return
            try:
                self._pass()
            except LeaseLost as exc:  # another trainer writes the run now: write nothing more
                log.error("%s", exc)
                self.lost = exc
                self._final_done.set()
                return
            except Exception as exc:  # the store's trouble never reaches the training
                backoff = backoff_seconds(
                    self._failures + 1,
                    self.config.retry_backoff_seconds,
                    self.config.max_retry_backoff_seconds,
                )
                self._failed(exc, backoff)
            else:
                backoff = 0.0
                self._succeeded()
            self._watch_lag()
            self._write_status()

    def _pass(self) -> None:
        # Read before the checkpoints are listed: `finish` comes after the last checkpoint is
        # published, so a pass that sees it lists that checkpoint too. Read after the listing, a
        # pass already uploading an older one ended the run's uploads without the final one.
        final = self._final
        if not self._store_known or self._failures:  # learnt again after trouble
            whole = self.store.complete_steps()
            self.synced_step = whole[-1] if whole else None
            self._store_known = True
        self._keep_lease()
        for tag in self._published_tags():
            step = step_of(tag)
            if not self._needs_upload(step):
                continue
            if self.holder is not None:
                check_lease(self.store, self.holder)
            self.store.upload_checkpoint(
                self.checkpointer.run_dir / tag,
                after_first_file=functools.partial(self.after_first_file, step),
            )
            self.store.publish(tag)
            self.synced_step = step
            with self._lock:
                self._saved_at = {s: t for s, t in self._saved_at.items() if s > step}
            self.store.prune(self.config.keep_checkpoints)
            log.info("run store %s: %s uploaded", self.store.url, tag)
            self._logs_due_at = 0.0
        if final is not None or self.clock() >= self._logs_due_at:
            self._upload_files(self.logs)
            self.store.write_json("record.json", self.record)
            launch, launch_id = self.record.get("launch"), self.record.get("launch_id")
            if launch and launch_id:
                self.store.write_launch(launch_id, launch)
            self.store.write_json(STORE_STATUS_FILE, self._status().to_dict())
            self._logs_due_at = self.clock() + 60 * self.config.sync_logs_every_minutes
        if final is not None:
            self._upload_files(final)
            self.store.write_json(STORE_STATUS_FILE, self._status().to_dict())
            self._final_done.set()

    def _keep_lease(self) -> None:
        if self.holder is None or self.clock() < self._lease_due_at:
            return
        if self._lease_taken:
            check_lease(self.store, self.holder)
            renew_lease(self.store, self.holder)
        else:  # the store did not answer when the run started
            take_lease(self.store, self.holder)
            self._lease_taken = True
        self._lease_due_at = self.clock() + LEASE_HEARTBEAT_SECONDS

    def _published_tags(self) -> list[str]:
        """Local checkpoints up to what `latest` names, with their manifest, oldest first."""
        latest = tag_step(self.checkpointer.latest_tag() or "")
        if latest is None:
            return []
        return [
            tag
            for tag in self.checkpointer.tags()
            if step_of(tag) <= latest
            and (self.checkpointer.run_dir / tag / CHECKPOINT_MANIFEST).is_file()
        ]

    def _upload_files(self, entries: list[Mirrored]) -> None:
        for local, remote in entries:
            for path, relative in _files(local, remote):
                stat = path.stat()
                if self._uploaded.get(path) == (stat.st_size, stat.st_mtime_ns):
                    continue
                self.store.upload_file(path, relative)
                self._uploaded[path] = (stat.st_size, stat.st_mtime_ns)

    def _failed(self, exc: Exception, backoff: float) -> None:
        self._failures += 1
        self._last_error = exception_summary(exc)
        log.warning(
            "run store %s: upload attempt %d failed (%s); next attempt in %gs, training goes on",
            self.store.url,
            self._failures,
            self._last_error,
            backoff,
        )
        if self._failures == self.config.failures_before_alert:
            self._unreachable_alerted = True
            self.alerts.store_unreachable(
                self.store.url, self._failures, self._last_error, len(self._waiting())
            )

    def _waiting(self) -> list[int]:
        with self._lock:
            return sorted(s for s in self._saved_at if self._needs_upload(s))

    def _succeeded(self) -> None:
        self._failures = 0
        self._last_error = ""

    def _watch_lag(self) -> None:
        lag = self.lag()
        if lag.seconds > self.config.max_lag_seconds and not self._lag_alerted:
            self._lag_alerted = True
            self.alerts.store_sync_lag(
                self.store.url, lag.seconds, lag.steps, self.config.max_lag_seconds
            )
        if (
            not lag.seconds
            and not self._failures
            and (self._lag_alerted or self._unreachable_alerted)
        ):
            self._lag_alerted = self._unreachable_alerted = False
            tag = tag_for(self.synced_step) if self.synced_step is not None else "none"
            self.alerts.store_caught_up(self.store.url, tag)

    def _status(self) -> SyncState:
        lag = self.lag()
        return SyncState(
            run_id=self.store.run_id,
            launch_id=self.record.get("launch_id"),
            state=self.state,
            host=socket.gethostname(),
            updated_at=time.time(),
            store=self.store.url,
            store_step=self.synced_step,
            lag_steps=lag.steps,
            lag_seconds=round(lag.seconds, 1),
            failures=self._failures,
            last_error=self._last_error or None,
        )

    def _write_status(self) -> None:
        try:
            atomic_write_text(self.checkpointer.run_dir / SYNC_STATE_FILE, self._status().to_json())
        except OSError as exc:  # a full disk is the checkpointer's to report
            log.debug("could not write %s: %s", SYNC_STATE_FILE, exc)


def _files(local: Path, remote: str) -> list[Mirrored]:
    """The files of a mirrored file or folder, each with its place in the store."""
    if local.is_file():
        return [(local, remote)]
    if not local.is_dir():
        return []
    return [
        (path, f"{remote}/{path.relative_to(local).as_posix()}")
        for path in sorted(local.rglob("*"))
        if path.is_file()
    ]


def open_store(config: StorageConfig, run_id: str) -> RunStore | None:
    return RunStore(config.remote, run_id) if config.remote else None


def start_store_sync(
    config: StorageConfig,
    params: dict,
    store: RunStore,
    checkpointer: Checkpointer,
    alerts: AlertMonitor,
    paths: dict[str, Path],
    label: str,
    start_step: int,
    holder: Holder | None = None,
    lease_taken: bool = False,
    after_first_file: AfterFirstFile = lambda step: None,
) -> StoreSync:
    """The uploader of this run, started; on a disk that lacks the run's curves (a run moved to
    another host), they are fetched from the store first, so the logs go on where they were.
    `params`: what the run trains with, for its record in the store."""
    logs = [
        (paths["logs"] / label, f"logs/{label}"),
        (paths["metrics"] / "train.tsv", "metrics/train.tsv"),
        (paths["metrics"] / "val.tsv", "metrics/val.tsv"),
    ]
    if start_step:
        _restore_curves(store, logs)
    launch = launch_record()
    record = {
        "run_id": store.run_id,
        "launch_id": launch_id_of(launch) if launch else None,  # clipforge.ids: the two ids
        "config": params,
        "host": socket.gethostname(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "start_step": start_step,
        "launch": launch,
    }
    sync = StoreSync(
        store,
        checkpointer,
        config,
        alerts,
        logs,
        record,
        after_first_file,
        holder=holder,
        lease_taken=lease_taken,
    )
    return sync.start()


def take_store_lease(store: RunStore, holder: Holder) -> bool:
    """Take the run's lease in the store before anything is written there; False (and a line)
    when the store does not answer: the uploader takes it at its first pass then."""
    try:
        take_lease(store, holder)
    except Exception as exc:  # an unreachable store is no reason not to train
        log.warning("run store %s: lease not taken yet (%s)", store.url, exception_summary(exc))
        return False
    return True


def _restore_curves(store: RunStore, logs: list[Mirrored]) -> None:
    """TensorBoard files this disk lacks; a metrics TSV without a row of this run."""
    try:
        for local, remote in logs:
            if remote.startswith("logs/"):
                store.download_trees({remote: local}, keep_existing=True)
            elif not (local.is_file() and store.run_id in local.read_text(encoding="utf-8")):
                local.parent.mkdir(parents=True, exist_ok=True)
                store.download_file(remote, local)
    except Exception as exc:  # the curves are a convenience: never a reason not to train
        log.warning("run store %s: could not fetch the run's curves (%s)", store.url, exc)


def launch_record() -> dict | None:
    """The record `fab train` wrote for this launch (CLIPFORGE_RUN_RECORD), if any."""
    path = os.environ.get(RUN_RECORD_ENV)
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning(
            "%s=%s: not readable (%s); the store gets no launch record", RUN_RECORD_ENV, path, exc
        )
        return None
