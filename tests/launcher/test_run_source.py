"""The two places a run lives (clipforge.launcher.run_source) answer alike for the same run: its
run directory on a host, read over a real sshd by the host side's own status, and the run store's
copy of it (a local folder as the store), as `fab train`, the uploader and the recovery
controller write them."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fabric import Config

from clipforge.errors import LauncherError
from clipforge.launcher.connection import HostSpec
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.state import RunState, SupervisorState
from clipforge.launcher.recovery import (
    RECOVERY_FILE,
    ControllerState,
    Move,
    RecoveryRecord,
    store_record_path,
)
from clipforge.launcher.run_source import HostRun, RunSource, StoredRun
from clipforge.launcher.session import Settings, open_host
from clipforge.launcher.watch import show_status, watch_status
from clipforge.store.remote import RunStore
from clipforge.store.sync_state import STORE_STATUS_FILE, SYNC_STATE_FILE, SyncPhase, SyncState
from tests.conftest import REPO
from tests.support.records import run_record

LAUNCH_ID = "20261201-120000-0123456789"
RUN_ID = "run-0123456789ab"
TRAIN_TSV = (
    "run_id\tstep\tepoch\tloss\tstep_s\n"
    "run-fedcba987654\t9\t1.0\t0.1\t0.5\n"  # a committed run's row: not this launch's
    f"{RUN_ID}\t1\t0.25\t2.5\t0.5\n"
    f"{RUN_ID}\t2\t0.5\t2.25\t0.5\n"
)


@pytest.fixture
def both_places(sshd, tmp_path) -> Iterator[tuple[HostRun, StoredRun]]:
    """One finished run, moved once by its controller, with a store that is one step behind."""
    root, store_dir = tmp_path / "host", tmp_path / "store"
    layout = NodeLayout(root=str(root), launch_id=LAUNCH_ID, node_rank=0)
    code = Path(layout.code)
    (code / "metrics").mkdir(parents=True)
    (code / "src").symlink_to(REPO / "src")  # the shipped checkout's host side
    (code / "metrics" / "train.tsv").write_text(TRAIN_TSV)
    record = run_record(
        launch_id=LAUNCH_ID,
        checkpoints_dir=str(code / "checkpoints"),
        params={"storage": {"remote": str(store_dir)}},
    )
    Path(layout.record).write_text(record.to_json())
    Path(layout.state).write_text(
        SupervisorState(
            state=RunState.FINISHED, started_at=1.0e9, finished_at=1.0e9 + 60, max_restarts=5
        ).to_json()
    )
    sync = SyncState(
        run_id=RUN_ID, launch_id=LAUNCH_ID, state=SyncPhase.FINISHED, host="box",
        updated_at=1.0e9 + 60, store=f"{store_dir}/{RUN_ID}", store_step=1, lag_steps=1,
        lag_seconds=12.5, failures=2, last_error="OSError: full",
    )  # fmt: skip
    (code / "checkpoints" / RUN_ID).mkdir(parents=True)
    (code / "checkpoints" / RUN_ID / SYNC_STATE_FILE).write_text(sync.to_json())
    controller = RecoveryRecord(
        launch_id=LAUNCH_ID, state=ControllerState.FINISHED, controller="u@c:22",
        hosts=["u@b:22"], spares=[], max_moves=1,
        moves=[Move("u@a:22", "u@b:22", 1.0e9 + 30, "u@a:22 gone: 3 probes missed")],
    ).to_json()  # fmt: skip
    (Path(layout.run_dir) / RECOVERY_FILE).write_text(controller)

    store = RunStore(str(store_dir), RUN_ID)
    store.write_launch(LAUNCH_ID, record.to_dict())
    store.write_json(STORE_STATUS_FILE, sync.to_dict())
    store.upload_file(code / "metrics" / "train.tsv", "metrics/train.tsv")
    store.fs.pipe_file(f"{store_dir}/{store_record_path(LAUNCH_ID)}", controller.encode())

    settings = Settings(
        remote_root=str(root), python=sys.executable, stack_outputs=tmp_path / "none.json",
        min_free_gb=1, backoff_seconds=1, backoff_max_seconds=2, stop_timeout_seconds=9,
        shm_size="1g", registry=None,
    )  # fmt: skip
    spec = HostSpec(host=sshd.host, user=sshd.user, port=sshd.port, pinned_key=sshd.host_public_key)
    config = Config(overrides={"connect_kwargs": {"key_filename": [str(sshd.client_key)]}})
    host = open_host(spec, config, settings, None, accept_new_host_key=False)
    try:
        yield HostRun.on([host], LAUNCH_ID, settings), StoredRun.open(str(store_dir), LAUNCH_ID)
    finally:
        host.cxn.close()


def _rows(source: RunSource) -> dict[str, str]:
    lines: list[str] = []
    show_status(source, None, lines.append)
    assert lines[0] == f"{source.where}  launch {LAUNCH_ID}"
    text = re.sub(r"\n {4,}", " ", "\n".join(lines[1:]))  # a wrapped value, on one line again
    return dict(re.findall(r"^  (\w[\w ]*?)\s{2,}(.+)$", text, re.MULTILINE))


def test_status_rows_wrap_within_the_terminal_under_their_value(both_places, monkeypatch):
    """`fab status` at 80 columns: every line fits (but a word longer than the value column,
    which stays whole), a long value goes on under itself, and the rows say what they say at
    200. Into a pipe with no COLUMNS (pytest's capture is no terminal), each row is one line."""
    for source in both_places:
        monkeypatch.delenv("COLUMNS", raising=False)
        piped: list[str] = []
        show_status(source, None, piped.append)
        assert not any(re.match(r" {4,}\S", line) for line in piped), piped
        monkeypatch.setenv("COLUMNS", "200")
        wide = _rows(source)
        monkeypatch.setenv("COLUMNS", "80")
        lines: list[str] = []
        show_status(source, None, lines.append)
        too_long = [line for line in lines if len(line) > 80]
        # only where one word (a path) is longer than the value column, which it stays whole in
        assert all(len(line.split()[-1]) > 80 - 17 for line in too_long), too_long
        assert any(re.match(r" {4,}\S", line) for line in lines), lines  # one at least wrapped
        assert _rows(source) == wide


def test_host_and_store_give_the_same_answers_for_the_same_run(both_places):
    """The run record, the last row of this launch's own training, the uploader's sync state
    and the recovery controller's rows are the same read on the host and from the store; so are
    the status rows both show (the training run, the store's progress, the moves)."""
    on_host, in_store = both_places
    assert on_host.launch_id == in_store.launch_id == LAUNCH_ID
    assert on_host.record() == in_store.record()
    assert on_host.last_row() == in_store.last_row()
    assert on_host.last_row()["step"] == "2"
    assert on_host.sync_state() == in_store.sync_state()
    assert on_host.sync_state()[0] is not None
    assert on_host.recovery_rows() == in_store.recovery_rows()
    assert [key for key, _ in on_host.recovery_rows()] == ["recovery", "moved"]

    host_rows, store_rows = _rows(on_host), _rows(in_store)
    for key in ("run", "run store", "recovery", "moved"):
        assert host_rows[key] == store_rows[key], key
    assert host_rows["run"] == RUN_ID
    assert "step 1, behind by 1 steps" in store_rows["run store"]


def _watched(source: RunSource, running, finished) -> tuple[list[str], list[float]]:
    """`fab status --watch` over a run that is on (`running()` wrote its state) and finishes
    (`finished()`) during the first wait: the waits are where the run moves, not sleeps."""
    running()
    lines: list[str] = []
    waits: list[float] = []

    def run_ends(seconds: float) -> None:
        waits.append(seconds)
        assert len(waits) == 1, f"still watching a finished run: {lines}"
        finished()

    watch_status(source, None, lines.append, 7, "fab -H me@box", wait=run_ends)
    return lines, waits


def test_status_watch_shows_the_run_until_it_has_ended_then_the_next_step(both_places):
    """The table, then after each wait the table again (a blank line between), while the run is
    on (on the host, a supervisor gone is `lost`: its keeper may replace it, so watched on);
    once it has finished, no more waiting, and the next step: `fab fetch` from where it is."""
    on_host, in_store = both_places
    state_file = Path(on_host.layout.state)
    host_done = state_file.read_text()
    running = SupervisorState(state=RunState.RUNNING, started_at=1.0e9, max_restarts=5)
    store_done = in_store.sync_state()[0]
    store_running = dataclasses.replace(store_done, state=SyncPhase.TRAINING)
    for source, running_now, finish, where in (
        (on_host, lambda: state_file.write_text(running.to_json()),
         lambda: state_file.write_text(host_done), ""),
        (in_store, lambda: in_store.store.write_json(STORE_STATUS_FILE, store_running.to_dict()),
         lambda: in_store.store.write_json(STORE_STATUS_FILE, store_done.to_dict()),
         " --from-store"),
    ):  # fmt: skip
        lines, waits = _watched(source, running_now, finish)
        assert waits == [7]
        second = lines.index(f"{source.where}  launch {LAUNCH_ID}", 1)
        assert lines[second - 1] == "" and not any(x.startswith("next:") for x in lines[:second])
        assert lines[-1] == f"next: fab -H me@box fetch --launch {LAUNCH_ID}{where}"
    with pytest.raises(LauncherError, match="--interval: at least 1 second"):
        watch_status(in_store, None, print, 0.5)
