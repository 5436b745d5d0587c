"""A checkpoint is never lost: a start decides from what verifies (on disk and in the run store,
moto's S3 API), `latest` is only a hint, the one thing ever removed is a save that never
finished, the store is held to the same proof, and one run has one writer (a lock on its
directory, a lease in its store). On the reference run's real checkpoints (steps 8 and 12)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from clipforge.alerts.config import AlertsConfig
from clipforge.alerts.monitor import AlertMonitor
from clipforge.checkpoints.checkpointer import Checkpointer
from clipforge.checkpoints.layout import step_of
from clipforge.checkpoints.lock import Holder, lock_run_dir
from clipforge.checkpoints.resume import prepare_start
from clipforge.errors import StageError
from clipforge.store.config import StorageConfig
from clipforge.store.lease import LeaseLost, take_lease
from clipforge.store.remote import RunStore, missing_from_store
from clipforge.store.uploader import AfterFirstFile, StoreSync
from tests.conftest import REPO, run_train
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow

MODEL = "mp_rank_00_model_states.pt"
OPTIMIZER = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
BEFORE, NEWEST = "step-00000008", "step-00000012"


def _copy_run(reference_run: Path, into: Path) -> Path:
    shutil.copytree(reference_run / "checkpoints", into / "checkpoints")
    (run_dir,) = (into / "checkpoints").iterdir()
    return run_dir


def _tags(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("step-"))


# -- `latest` is a hint -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("marker", "said"),
    [
        (None, "no `latest`"),
        ("step-00000005\n", "`latest` names step-00000005"),
        (f"{BEFORE}\n", f"`latest` names {BEFORE}"),
    ],
    ids=["missing", "naming an absent older step", "naming an older checkpoint"],
)
def test_a_wrong_latest_resumes_from_the_newest_checkpoint_and_deletes_nothing(
    reference_run, tmp_path, caplog, marker, said
):
    """`latest` missing, naming a step that is not there, or an older one: every checkpoint is
    kept, the newest that verifies is chosen and named in one line, `latest` rewritten to it."""
    run_dir = _copy_run(reference_run, tmp_path)
    before = _tags(run_dir)
    if marker is None:
        (run_dir / "latest").unlink()
    else:
        (run_dir / "latest").write_text(marker)
    lines: list[str] = []
    with caplog.at_level(logging.INFO, "clipforge"):
        assert prepare_start(Checkpointer(run_dir, 2, True), None, lines.append) == NEWEST
    assert lines == []  # nothing damaged: no alert
    assert _tags(run_dir) == before
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == f"{run_dir}: {said}; resuming from {NEWEST}, the newest checkpoint that verifies"
    assert (run_dir / "latest").read_text() == f"{NEWEST}\n"


def test_a_save_cut_short_is_the_only_thing_removed(reference_run, tmp_path):
    """A folder newer than every finished checkpoint, with no manifest (the process died while
    DeepSpeed wrote it): removed. One without a manifest below a finished one lost it: set aside
    with the alert's line, never deleted."""
    run_dir = _copy_run(reference_run, tmp_path)
    shutil.copytree(run_dir / NEWEST, run_dir / "step-00000016")
    (run_dir / "step-00000016" / "manifest.json").unlink()
    (run_dir / BEFORE / "manifest.json").unlink()
    lines: list[str] = []
    assert prepare_start(Checkpointer(run_dir, 2, True), None, lines.append) == NEWEST
    assert _tags(run_dir) == [NEWEST]
    (aside,) = run_dir.glob(f"damaged-{BEFORE}-*")
    assert (aside / MODEL).is_file()
    (line,) = lines
    assert f"checkpoint {run_dir / BEFORE} is damaged: it has no manifest" in line
    assert str(aside) in line


def test_after_nothing_intact_the_rerun_starts_from_step_0(reference_run, tmp_path):
    """Every checkpoint damaged: StageError, everything set aside (the stale `latest` too), and
    the next start, as the line says, trains from step 0 instead of failing the same way."""
    run_dir = _copy_run(reference_run, tmp_path)
    for tag in _tags(run_dir):
        (run_dir / tag / MODEL).write_bytes(b"")
    lines: list[str] = []
    with pytest.raises(StageError, match="rerun the stage to train from step 0"):
        prepare_start(Checkpointer(run_dir, 2, True), None, lines.append)
    assert len(lines) == 2 and _tags(run_dir) == []
    assert not (run_dir / "latest").exists() and list(run_dir.glob("damaged-latest-*"))
    assert prepare_start(Checkpointer(run_dir, 2, True), None, lines.append) is None
    assert len(lines) == 2


# -- the store is held to the same proof ------------------------------------------------------
def _stored(s3, reference_run: Path) -> RunStore:
    (source,) = (reference_run / "checkpoints").iterdir()
    store = RunStore(f"{s3.new_bucket()}/runs", source.name)
    for tag in (BEFORE, NEWEST):
        store.upload_checkpoint(source / tag)
        store.publish(tag)
    return store


def test_a_store_checkpoint_missing_an_object_is_not_whole_for_any_guard(s3, reference_run):
    """One object of the store's newest checkpoint deleted: `missing_from_store` (what `fab
    clean` and `make down` ask) says it is not whole, and the store does not count it."""
    store = _stored(s3, reference_run)
    store.fs.rm_file(store.path(f"checkpoints/{NEWEST}/{MODEL}"))
    why = missing_from_store(store.remote, store.run_id, NEWEST)
    assert why == f"is not whole in the run store {store.remote} ({MODEL} is missing)"
    assert missing_from_store(store.remote, store.run_id, BEFORE) is None
    assert store.complete_steps() == [8]


def test_a_store_checkpoint_missing_an_object_is_set_aside_with_the_alert(
    s3, reference_run, tmp_path
):
    """No local checkpoint: the store's newest lacks an object. One line (the alert) names it,
    it is set aside in the store, and the store's previous one is fetched and chosen."""
    store = _stored(s3, reference_run)
    store.fs.rm_file(store.path(f"checkpoints/{NEWEST}/{MODEL}"))
    run_dir = tmp_path / "checkpoints" / store.run_id
    run_dir.mkdir(parents=True)
    lines: list[str] = []
    assert prepare_start(Checkpointer(run_dir, 2, True), store.checkpoints, lines.append) == BEFORE
    (line,) = lines
    assert f"checkpoint {store.url}/checkpoints/{NEWEST} is damaged: {MODEL} is missing" in line
    names = store.checkpoints.names()
    assert [n for n in names if n.startswith("step-")] == [BEFORE]
    (aside,) = [n for n in names if n.startswith(f"damaged-{NEWEST}-")]
    assert aside in line


def _sync(
    store: RunStore,
    checkpointer: Checkpointer,
    holder: Holder | None = None,
    after_first_file: AfterFirstFile = lambda step: None,
) -> StoreSync:
    return StoreSync(
        store,
        checkpointer,
        StorageConfig(remote=store.remote, flush_timeout_seconds=300),
        AlertMonitor(AlertsConfig(), store.run_id, targets=[]),
        logs=[],
        record={"run_id": store.run_id},
        after_first_file=after_first_file,
        holder=holder,
        lease_taken=holder is not None,
    )


def test_the_uploader_sends_again_what_the_store_lost_from_the_local_copy(
    s3, reference_run, tmp_path
):
    """The store's newest lacks an object, the disk has it intact: the start resumes from the
    local copy and sets the store's aside (with the alert), and the uploader's next pass puts it
    back whole."""
    store = _stored(s3, reference_run)
    store.fs.rm_file(store.path(f"checkpoints/{NEWEST}/{OPTIMIZER}"))
    run_dir = _copy_run(reference_run, tmp_path)
    checkpointer = Checkpointer(run_dir, 3, True)
    lines: list[str] = []
    assert prepare_start(checkpointer, store.checkpoints, lines.append) == NEWEST
    (line,) = lines
    assert f"{store.url}/checkpoints/{NEWEST} is damaged: {OPTIMIZER} is missing" in line
    sync = _sync(store, checkpointer).start()
    sync.finish("finished", [])
    assert store.complete_steps() == [8, 12]
    assert missing_from_store(store.remote, store.run_id, NEWEST) is None


def test_the_end_of_the_run_waits_for_the_checkpoint_saved_during_an_upload(
    s3, reference_run, tmp_path, caplog
):
    """The run ends while the uploader is sending an older checkpoint: the final one, published
    meanwhile, is uploaded before the end (a pass listed before the end once ended the uploads
    without it, and a finished run's store lacked its last checkpoint)."""
    run_dir = _copy_run(reference_run, tmp_path)
    saved_later = shutil.move(run_dir / NEWEST, tmp_path / NEWEST)
    (run_dir / "latest").write_text(BEFORE + "\n")
    store = RunStore(f"{s3.new_bucket()}/runs", run_dir.name)
    uploading, release = threading.Event(), threading.Event()

    def hold_first_upload(step: int) -> None:
        if not uploading.is_set():
            uploading.set()
            assert release.wait(60)

    checkpointer = Checkpointer(run_dir, 3, True)
    sync = _sync(store, checkpointer, after_first_file=hold_first_upload).start()
    sync.checkpoint_saved(step_of(BEFORE))
    assert uploading.wait(60)  # the pass has listed what `latest` names, and is uploading it
    shutil.move(saved_later, run_dir / NEWEST)  # the last step's checkpoint saved and published
    checkpointer.publish(NEWEST)
    sync.checkpoint_saved(step_of(NEWEST))
    ending = threading.Thread(target=sync.finish, args=("finished", []))
    with caplog.at_level(logging.INFO, "clipforge"):
        ending.start()
        wait_for(
            lambda: any("for the last uploads" in r.getMessage() for r in caplog.records),
            what="the end of the run waiting for the uploads",
        )
    release.set()
    ending.join(120)
    assert not ending.is_alive()
    assert store.complete_steps()[-1] == step_of(NEWEST)


# -- one run, one writer ------------------------------------------------------------------------
_HOLD = """
import sys
from pathlib import Path
from clipforge.checkpoints.lock import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()
"""


def _holding(run_dir: Path) -> subprocess.Popen:
    """Another process holding the run directory's lock until its stdin closes (or it is
    killed); returns once it holds it."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert process.stdout.readline() == "locked\n"
    return process


def test_a_second_trainer_refuses_naming_the_holder_and_a_dead_one_is_taken_over(tmp_path, caplog):
    """A live holder: StageError naming its host, pid and start time. Killed with SIGKILL (no
    clean-up): the kernel dropped its flock, so the next trainer takes the lock and says whose
    it was; as the supervisor's restarts do."""
    run_dir = tmp_path / "checkpoints" / "run-abc"
    holder = _holding(run_dir)
    try:
        with pytest.raises(StageError) as refused:
            lock_run_dir(run_dir)
        line = str(refused.value)
        assert "\n" not in line
        assert f"is being trained by pid {holder.pid} on {os.uname().nodename}, started " in line
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with caplog.at_level(logging.INFO, "clipforge"):
        lock = lock_run_dir(run_dir)
    assert f"taking over the lock of pid {holder.pid} on" in caplog.text
    assert json.loads((run_dir / "writer.lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_the_train_stage_refuses_a_locked_run_before_building_anything(
    reference_run, small_data, tmp_path, capsys
):
    """Two trainers of one run directory: the second stops with exit 2 and one line naming the
    first, before the model is built (no batch plan, no model, no metrics written)."""
    (reference_dir,) = (reference_run / "checkpoints").iterdir()
    run_dir = tmp_path / "checkpoints" / reference_dir.name
    holder = _holding(run_dir)
    try:
        assert run_train(tmp_path, small_data) == 2
    finally:
        holder.stdin.close()
        holder.wait()
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"is being trained by pid {holder.pid} on" in errors[0]
    assert sorted(p.name for p in run_dir.iterdir()) == ["writer.lock"]
    assert not (tmp_path / "models").exists() and not (tmp_path / "metrics").exists()


def test_a_trainer_whose_store_lease_was_taken_writes_nothing_more_and_stops(
    s3, reference_run, tmp_path
):
    """Trainer A keeps the lease; trainer B (another host, the run moved) takes it. A's next
    upload finds it gone: it uploads nothing more, and its next save stops the training with
    one line naming B."""
    (source,) = (reference_run / "checkpoints").iterdir()
    store = RunStore(f"{s3.new_bucket()}/runs", source.name)
    a, b = Holder.this_process(), Holder("host-b", 4242, "2026-01-01T00:00:00Z", "b" * 16)
    take_lease(store, a)
    run_dir = _copy_run(reference_run, tmp_path)
    sync = _sync(store, Checkpointer(run_dir, 3, True), holder=a)
    take_lease(store, b)
    sync.start()
    assert sync._final_done.wait(300)  # set when the uploader gives the run up
    assert isinstance(sync.lost, LeaseLost)
    assert store.complete_steps() == []  # nothing of A's went up after B took over
    with pytest.raises(LeaseLost, match="is now written by pid 4242 on host-b"):
        sync.checkpoint_saved(16)
    sync.finish("failed", [])
    assert json.loads(store.fs.cat_file(store.path("lease.json")))["host"] == "host-b"


def test_the_lease_is_released_at_a_clean_end(s3, reference_run, tmp_path):
    (source,) = (reference_run / "checkpoints").iterdir()
    store = RunStore(f"{s3.new_bucket()}/runs", source.name)
    holder = Holder.this_process()
    take_lease(store, holder)
    sync = _sync(store, Checkpointer(_copy_run(reference_run, tmp_path), 3, True), holder)
    sync.start().finish("finished", [])
    assert store.complete_steps() == [8, 12]
    assert not store.fs.exists(store.path("lease.json"))


# -- one line, before heavy work ----------------------------------------------------------------
def test_an_unusable_alert_webhook_stops_the_stage_before_anything_is_built(
    small_data, tmp_path, capsys, monkeypatch
):
    """CLIPFORGE_ALERT_WEBHOOKS='not a url': exit 2 with one line, before the model is built
    (it came after ~60 s of it) and with nothing written (it left batch_plan.json)."""
    monkeypatch.setenv("CLIPFORGE_ALERT_WEBHOOKS", "not a url")
    assert run_train(tmp_path, small_data) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "CLIPFORGE_ALERT_WEBHOOKS" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_the_end_of_a_run_says_how_long_it_waits_for_a_failing_store(
    reference_run, tmp_path, caplog
):
    """A store that does not answer: the end of the run says it waits, for how long and how to
    leave (it waited storage.flush_timeout_seconds without a word), then what is left behind."""
    from tests.support.s3store import unreachable_store

    run_dir = _copy_run(reference_run, tmp_path)
    store = unreachable_store(run_dir.name)
    sync = StoreSync(
        store,
        Checkpointer(run_dir, 2, True),
        StorageConfig(remote=store.remote, flush_timeout_seconds=0),
        AlertMonitor(AlertsConfig(), store.run_id, targets=[]),
        logs=[],
        record={},
    )
    with caplog.at_level(logging.INFO, "clipforge"):
        sync.start().finish("finished", [])
    said = [r.getMessage() for r in caplog.records]
    assert any(
        "waiting up to 0s (storage.flush_timeout_seconds) for the last uploads" in m
        and "Ctrl-C leaves them on this disk" in m
        for m in said
    )
    assert any("not everything uploaded after 0s" in m for m in said)
