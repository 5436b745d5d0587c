"""A run read from its run store (storage.remote) rather than from a host, which may be gone:
`fab status --run RUN` without -H, `fab fetch --from-store`, `fab tensorboard --from-store`; and
`fab clean`'s question "does the store hold this run's newest checkpoint?".

The store is reached from this machine, with its credentials (the library's usual environment
or profile); `fab train` recorded each launch there (launches/<run>.json), which names the
training run whose files the store keeps (clipforge.store.remote).
"""

from __future__ import annotations

import csv
import io
import json
import posixpath
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from clipforge.fsutil import replace_dir_atomically
from clipforge.launcher import LauncherError, recovery
from clipforge.launcher.connection import q, run
from clipforge.launcher.fetch import RESULTS
from clipforge.launcher.host import stored_checkpoints
from clipforge.launcher.host.record import RunRecord, RunRecordError, record_from_dict
from clipforge.launcher.host.status import sync_text
from clipforge.launcher.session import Host, Settings
from clipforge.store.remote import RunStore, missing_from_store, read_launch
from clipforge.store.sync_state import (
    STORE_STATUS_FILE,
    SyncState,
    SyncStateError,
    parse_sync_state,
)
from clipforge.util import format_duration, wait_until_answering

Say = Callable[[str], None]
TENSORBOARD_START_SECONDS = 120.0


def open_run(remote: str | None, launch_id: str | None) -> tuple[RunStore, RunRecord]:
    """The store's place of launch `launch_id`, and the launch's record (its run.json as the
    train stage copied it there, clipforge.launcher.host.record's reader)."""
    if not launch_id:
        raise LauncherError("--run RUN: which run to read from the run store")
    if not remote:
        raise LauncherError(
            "no run store to read from: pass --store URL, or set storage.remote in params.yaml"
        )
    try:
        launch = read_launch(remote, launch_id)
    except Exception as exc:  # any library's error (no credentials, unreachable): one line
        raise LauncherError(f"run store {remote}: {exc}") from None
    if launch is None:
        raise LauncherError(
            f"the run store {remote} has no run {launch_id} (no launches/{launch_id}.json)"
        )
    source = f"{remote} launches/{launch_id}.json"
    training_run = launch.get("training_run")
    if not isinstance(training_run, str):
        raise LauncherError(f"{source}: training_run is {training_run!r}, not a run id")
    try:
        record = record_from_dict(launch, source)
    except RunRecordError as exc:
        raise LauncherError(str(exc)) from None
    try:
        store = RunStore(remote, training_run)
    except Exception as exc:  # as above
        raise LauncherError(f"run store {remote}: {exc}") from None
    return store, record


def show_status(remote: str | None, launch_id: str | None, say: Say) -> None:
    """Where the run stands as the store last heard of it: state, host, step, loss, sync lag."""
    store, launch = open_run(remote, launch_id)
    status, status_error = _store_status(store)
    row = _last_row(store)
    if status:
        ago = format_duration(time.time() - status.updated_at)
        state = f"{status.state} on {status.host}, as of {ago} ago"
    else:
        state = f"unknown: {status_error}" if status_error else "unknown"
    rows = [
        ("launch", f"{launch_id} (commit {launch.commit[:10]}, {store.url})"),
        ("run", store.run_id),
        ("state", state),
        ("step", row.get("step", "-")),
        ("loss", row.get("loss", "-")),
        (
            "run store",
            sync_text(status) if status else "-" if status_error else "no status written yet",
        ),
        *_recovery_rows(store, launch_id),
    ]
    width = max(len(k) for k, _ in rows)
    say(f"run store  launch {launch_id}")
    for key, value in rows:
        say(f"  {key:<{width}}  {value}")


def _recovery_rows(store: RunStore, launch_id: str) -> list[tuple[str, str]]:
    """The recovery controller's rows (`fab train --spare`) from its record in the store."""
    path = posixpath.join(posixpath.dirname(store.root), recovery.store_record_path(launch_id))
    try:
        text = store.fs.cat_file(path).decode("utf-8")
    except FileNotFoundError:
        return []
    try:
        return recovery.status_rows(recovery.parse_record(text, f"{store.remote}: {path}"))
    except recovery.RecordError as exc:
        return [("recovery", f"unreadable: {exc}")]


def fetch(remote: str | None, launch_id: str | None, destination: Path, say: Say) -> Path:
    """metrics/, models/clip/ and logs/ as the store has them (those of `fab fetch` from a host),
    and the store's record and status of the run, into destination/<run>/, replaced whole."""
    store, _ = open_run(remote, launch_id)
    target = destination / launch_id
    with replace_dir_atomically(target) as tmp:
        for prefix in RESULTS:
            _download_tree(store, prefix, tmp / prefix)
        for name in ("record.json", STORE_STATUS_FILE):
            store.download_file(name, tmp / "store" / name)
    say(f"fetched {launch_id} from {store.url} into {target}")
    return target


def tensorboard(
    remote: str | None, launch_id: str | None, destination: Path, port: int, say: Say
) -> None:
    """The run's TensorBoard events downloaded into destination/<run>/logs, served by a local
    TensorBoard until interrupted."""
    store, _ = open_run(remote, launch_id)
    logdir = destination / launch_id / "logs"
    count = _download_tree(store, "logs", logdir)
    say(f"{count} log files of {launch_id} from {store.url} in {logdir}")
    argv = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
    log = logdir.parent / "tensorboard.log"
    with open(log, "wb") as output:
        server = subprocess.Popen(
            [*argv, "--host", "127.0.0.1", "--port", str(port)], stdout=output, stderr=output
        )
    try:
        _wait_until_answering(server, f"http://127.0.0.1:{port}/", log)
        say(f"TensorBoard for {launch_id}: http://127.0.0.1:{port}/  (Ctrl-C to stop)")
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.terminate()
        server.wait()


def unstored_checkpoints(host: Host, settings: Settings, launch_ids: list[str]) -> list[str]:
    """The newest checkpoints of the launches `launch_ids` on the host that their run store does not
    hold whole (none for a run without a store), each with its run and why; one listing of the
    host's checkpoints for all of them."""
    script = stored_checkpoints.script_source()
    listed = run(
        host.cxn,
        f"{q(settings.python)} -c {q(script)} --root {q(host.root)}",
        what="listing the run's checkpoints",
    )
    problems = []
    for entry in json.loads(listed.stdout):
        if entry["launch_id"] in launch_ids and entry.get("store"):
            why = missing_from_store(entry["store"], entry["run_id"], entry["tag"])
            if why:
                problems.append(
                    f"{host.label} run {entry['launch_id']}: {entry['run_id']}/{entry['tag']} {why}"
                )
    return problems


def _download_tree(store: RunStore, prefix: str, into: Path) -> int:
    names = store.files(prefix)
    for name in names:
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        store.download_file(f"{prefix}/{name}", into / name)
    return len(names)


def _store_status(store: RunStore) -> tuple[SyncState | None, str | None]:
    """The uploader's last word in the store (status.json), or what is wrong with it."""
    try:
        text = store.fs.cat_file(store.path(STORE_STATUS_FILE))
    except FileNotFoundError:
        return None, None
    try:
        return parse_sync_state(text, f"{store.url}/{STORE_STATUS_FILE}"), None
    except SyncStateError as exc:
        return None, str(exc)


def _last_row(store: RunStore) -> dict:
    """The last row of this training run in the store's metrics/train.tsv."""
    try:
        text = store.fs.cat_file(store.path("metrics/train.tsv")).decode("utf-8")
    except FileNotFoundError:
        return {}
    rows = csv.DictReader(io.StringIO(text), delimiter="\t")
    own = [r for r in rows if r.get("run_id") == store.run_id]
    return own[-1] if own else {}


def _wait_until_answering(server: subprocess.Popen, url: str, log: Path) -> None:
    if wait_until_answering(url, TENSORBOARD_START_SECONDS, alive=lambda: server.poll() is None):
        return
    if server.poll() is not None:
        raise LauncherError(f"TensorBoard exited: {log.read_text(errors='replace')[-2000:]}")
    raise LauncherError(f"TensorBoard did not answer at {url}")
