"""The run store on a real S3 API (moto's server on 127.0.0.1, s3fs as the client): a run copied
there while it trains outlives its host, a torn upload is never used, and a store that goes down
never stops training."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from clipforge.checkpoints.checkpointer import Checkpointer
from clipforge.checkpoints.resume import prepare_start
from clipforge.store.remote import RunStore
from tests.conftest import subprocess_env, train_argv, write_params
from tests.support.s3store import SECRET_KEY, unreachable_store
from tests.support.wait import still_running, wait_for

pytestmark = pytest.mark.slow
# The store's real runs (a moved run, 45 s; a store that goes down, 40 s): in make test-tier2
# (.ci/run), beside the same through `fab` (tests/launcher/test_moved_run.py). make test keeps the
# store's proof of a checkpoint (test_guard_bytes.py), its sync state (test_sync_state.py), the
# uploader sending again what the store lost (checkpoints/test_never_lost.py) and the two cheap
# runs at the end of this file.
tier2 = pytest.mark.tier2

OPTIMIZER = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _stage(root: Path, data: Path, env: dict, *sets: str) -> subprocess.Popen:
    """The train stage as a process of its own, its output in root/stage.log."""
    write_params(root / "params.yaml")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clipforge.train",
            *train_argv(root, data, root / "params.yaml"),
            *[arg for item in sets for arg in ("--set", item)],
        ],
        env={**subprocess_env(), **env},
        stdout=subprocess.DEVNULL,
        stderr=open(root / "stage.log", "wb"),  # noqa: SIM115 - the child holds it
    )


def _wait(predicate, process: subprocess.Popen, what: str, timeout: float = 300) -> None:
    """Until predicate() (a safety limit, not a speed assertion); the process must stay alive."""
    wait_for(predicate, what=what, timeout=timeout, interval=0.2, check=still_running(process))


def _objects(fs, prefix: str) -> list[str]:
    fs.invalidate_cache()
    try:
        return fs.find(prefix)
    except FileNotFoundError:
        return []


def _latest(fs, run_url: str) -> str | None:
    fs.invalidate_cache()
    try:
        return fs.cat_file(f"{run_url}/checkpoints/latest").decode().strip()
    except FileNotFoundError:
        return None


def _run_url(fs, remote: str) -> str:
    """The one training run's place under `remote` (it is named by the run id)."""
    fs.invalidate_cache()
    (run,) = [p for p in fs.ls(remote, detail=False) if p.rsplit("/", 1)[-1].startswith("run-")]
    return f"s3://{run}"


def _same_weights(a: Path, b: Path) -> bool:
    expected = load_file(str(a / "models" / "clip" / "open_clip_model.safetensors"))
    got = load_file(str(b / "models" / "clip" / "open_clip_model.safetensors"))
    return expected.keys() == got.keys() and all((expected[k] == got[k]).all() for k in expected)


# -- a run that loses its host ------------------------------------------------------------------
@pytest.fixture(scope="module")
def moved_run(s3_server, small_data, tmp_path_factory):
    """A run on host A syncs step 4 to the store; the upload of step 8 is held after its first
    file (hold_upload@8) and the process killed there, a torn upload; A's directory is deleted.
    The same stage on host B (another directory) then runs to the end."""
    base = tmp_path_factory.mktemp("moved-run")
    remote = f"{s3_server.new_bucket()}/runs"
    fs = s3_server.filesystem()
    sets = (f"storage.remote={remote}",)
    host_a, host_b = base / "a", base / "b"
    host_a.mkdir()
    host_b.mkdir()
    first = _stage(
        host_a, small_data, {**s3_server.env, "CLIPFORGE_FAULTS": "hold_upload@8"}, *sets
    )
    try:
        _wait(lambda: _objects(fs, remote), first, "the first upload")
        run_url = _run_url(fs, remote)
        _wait(
            lambda: (
                _latest(fs, run_url) == "step-00000004"
                and _objects(fs, f"{run_url}/checkpoints/step-00000008")
            ),
            first,
            "step 4 in the store and step 8 half uploaded",
        )
    finally:
        first.kill()
        first.wait()
    torn = [p.rsplit("/", 1)[-1] for p in _objects(fs, f"{run_url}/checkpoints/step-00000008")]
    stage_a_log = (host_a / "stage.log").read_text()
    shutil.rmtree(host_a)  # the host is gone
    second = _stage(host_b, small_data, s3_server.env, *sets)
    code = second.wait(timeout=600)
    return {
        "fs": fs,
        "run_url": run_url,
        "torn": torn,
        "host_b": host_b,
        "code": code,
        "logs": stage_a_log + (host_b / "stage.log").read_text(),
    }


@tier2
def test_a_run_whose_host_is_gone_resumes_elsewhere_from_the_store_to_the_same_weights(
    moved_run, reference_run
):
    """Host B has nothing of the run but its data and params: it fetches the store's checkpoint,
    trains on and ends with the weights and losses of the uninterrupted run."""
    host_b = moved_run["host_b"]
    assert moved_run["code"] == 0, moved_run["logs"][-3000:]
    info = json.loads((host_b / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == 4
    assert _same_weights(reference_run, host_b)
    summary = json.loads((host_b / "metrics" / "train.json").read_text())
    reference = json.loads((reference_run / "metrics" / "train.json").read_text())
    assert (summary["loss"], summary["val_loss"]) == (reference["loss"], reference["val_loss"])


@tier2
def test_a_torn_upload_is_never_chosen(moved_run):
    """Step 8 was in the store in part (no manifest, `latest` still at step 4) when its writer
    was killed: host B took step 4, and step 8 was uploaded whole later."""
    assert moved_run["torn"] and "manifest.json" not in moved_run["torn"]
    assert "fetching step-00000004 from the run store" in moved_run["logs"]
    assert "fetching step-00000008" not in moved_run["logs"]


@tier2
def test_the_store_keeps_the_last_checkpoints_and_the_curves_of_both_hosts(moved_run):
    """The store ends with the last storage.keep_checkpoints (2) checkpoints, `latest` naming the
    final one; the TensorBoard events of host A and host B; train.tsv with every step once (B
    took A's rows up to its checkpoint from the store); the model and the finished status."""
    fs, run_url = moved_run["fs"], moved_run["run_url"]
    assert _latest(fs, run_url) == "step-00000012"
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{run_url}/checkpoints", detail=False)}
    assert names == {"latest", "step-00000008", "step-00000012"}
    events = [p for p in _objects(fs, f"{run_url}/logs") if "tfevents" in p]
    assert len(events) == 2  # one file per host
    rows = fs.cat_file(f"{run_url}/metrics/train.tsv").decode().splitlines()[1:]
    assert [int(row.split("\t")[0]) for row in rows] == [2, 4, 6, 8, 10, 12]
    assert fs.exists(f"{run_url}/models/clip/open_clip_model.safetensors")
    status = json.loads(fs.cat_file(f"{run_url}/status.json"))
    assert status["state"] == "finished" and status["store_step"] == 12
    # the training run's id; no launch id, as no `fab train` started these stages
    assert status["run_id"] == run_url.rsplit("/", 1)[-1] and status["launch_id"] is None


@tier2
def test_nothing_a_run_writes_holds_the_store_credentials(moved_run):
    """The secret key reached the stage through the environment only: it is in no object of the
    store (record, status, logs, checkpoints), no file host B wrote and no line of the logs."""
    fs, run_url = moved_run["fs"], moved_run["run_url"]
    secret = SECRET_KEY.encode()
    record = json.loads(fs.cat_file(f"{run_url}/record.json"))
    assert record["config"]["storage"]["remote"].startswith("s3://")
    for path in _objects(fs, run_url):
        assert secret not in fs.cat_file(path), path
    for path in moved_run["host_b"].rglob("*"):
        assert not path.is_file() or secret not in path.read_bytes(), path
    assert SECRET_KEY not in moved_run["logs"]


# -- the store goes down -------------------------------------------------------------------------
@tier2
def test_a_store_that_goes_down_mid_run_neither_stops_training_nor_loses_a_checkpoint(
    s3, small_data, reference_run, tmp_path
):
    """Step 4 reaches the store; the store then goes down before step 5 may start (wait@5). The
    run trains to its end regardless, alerts (store_unreachable, store_sync_lag), keeps step 8 on
    its disk although train.keep_checkpoints is 1 (the store lacks it), and waits for the store.
    Back up, the store gets steps 8 and 12 (store_caught_up); the run ends as an uninterrupted one."""
    remote = f"{s3.new_bucket()}/runs"
    fs = s3.filesystem()
    go = tmp_path / "store-is-down"
    stage = _stage(
        tmp_path,
        small_data,
        {**s3.env, "CLIPFORGE_FAULTS": f"wait@5={go}"},
        f"storage.remote={remote}",
        "train.keep_checkpoints=1",
        "storage.keep_checkpoints=3",
        "storage.failures_before_alert=1",
        "storage.max_lag_seconds=5",
        "storage.retry_backoff_seconds=0.5",
        "storage.max_retry_backoff_seconds=2",
    )
    log = tmp_path / "stage.log"
    local = tmp_path / "checkpoints"
    try:
        _wait(lambda: _objects(fs, remote), stage, "the first upload")
        run_url = _run_url(fs, remote)
        _wait(lambda: _latest(fs, run_url) == "step-00000004", stage, "step 4 in the store")
        s3.stop()
        go.touch()
        _wait(
            lambda: (
                "store_unreachable" in log.read_text()
                and "store_sync_lag" in log.read_text()
                and (local / run_url.rsplit("/", 1)[-1] / "latest").is_file()
                and (local / run_url.rsplit("/", 1)[-1] / "latest").read_text() == "step-00000012\n"
                # training went on to its end: the export follows the final checkpoint (a
                # loaded machine can be seen between the two)
                and (tmp_path / "models" / "clip").is_dir()
            ),
            stage,
            "the alerts, the final checkpoint and the export with the store down",
        )
        run_dir = local / run_url.rsplit("/", 1)[-1]
        kept = sorted(p.name for p in run_dir.glob("step-*"))
        assert kept == ["step-00000008", "step-00000012"]  # 8 waits for the store
        s3.start()
        assert stage.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait()
        s3.start()
    text = log.read_text()
    assert "store_caught_up" in text and "up to step-00000012" in text
    fs.invalidate_cache()
    complete = sorted(
        p.rsplit("/", 2)[-2]
        for p in _objects(fs, f"{run_url}/checkpoints")
        if p.endswith("manifest.json")
    )
    assert complete == ["step-00000004", "step-00000008", "step-00000012"]
    assert _latest(fs, run_url) == "step-00000012"
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-00000012"]  # uploaded: pruned
    assert _same_weights(reference_run, tmp_path)


# -- damage in the store -------------------------------------------------------------------------
def test_a_damaged_checkpoint_in_the_store_is_set_aside_and_the_one_before_used(
    s3, reference_run, tmp_path
):
    """A host with no checkpoint of the run; the store's newest has a truncated optimizer file:
    one line names it there, it is moved aside in the store (kept), and the store's previous
    checkpoint is downloaded, verified and chosen."""
    (source,) = (reference_run / "checkpoints").iterdir()
    store = RunStore(f"{s3.new_bucket()}/runs", source.name)
    for tag in ("step-00000008", "step-00000012"):
        store.upload_checkpoint(source / tag)
        store.publish(tag)
    broken = store.path(f"checkpoints/step-00000012/{OPTIMIZER}")
    store.fs.pipe_file(broken, store.fs.cat_file(broken)[:1000])
    run_dir = tmp_path / "checkpoints" / source.name
    run_dir.mkdir(parents=True)
    lines: list[str] = []
    assert (
        prepare_start(Checkpointer(run_dir, 2, True), store.checkpoints, lines.append)
        == "step-00000008"
    )
    (line,) = lines
    assert (
        f"checkpoint {store.url}/checkpoints/step-00000012 is damaged: {OPTIMIZER} is truncated"
        in line
    )
    aside = [p for p in store.fs.ls(store.path("checkpoints"), detail=False) if "damaged-" in p]
    assert len(aside) == 1 and aside[0].rsplit("/", 1)[-1] in line
    assert (run_dir / "latest").read_text() == "step-00000008\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["latest", "step-00000008"]


def test_an_unreachable_store_at_start_is_no_reason_not_to_train(reference_run, tmp_path, caplog):
    """Nothing answers at the store's endpoint: the newest local checkpoint is chosen, with a
    line saying the store could not be reached."""
    shutil.copytree(reference_run / "checkpoints", tmp_path / "checkpoints")
    (run_dir,) = (tmp_path / "checkpoints").iterdir()
    store = unreachable_store(run_dir.name)
    lines: list[str] = []
    assert (
        prepare_start(Checkpointer(run_dir, 2, True), store.checkpoints, lines.append)
        == "step-00000012"
    )
    assert lines == []
    assert f"run store {store.checkpoints.where} not reachable" in caplog.text
