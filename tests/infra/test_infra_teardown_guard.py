"""The teardown guard on real parts: a worker reached over a real sshd on 127.0.0.1 (this machine,
its "volumes" temporary directories), runs laid out as `fab train` lays them out, and a DVC
remote filled by the real `dvc push`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from infra_harness import run_program, stack_config
from stack_worker import forget_roots, record_root, stack_outputs, write_run

from clipforge.checkpoints.manifest import write_manifest
from clipforge.launcher.host.stored_checkpoints import newest_checkpoints
from clipforge.store.remote import RunStore
from clipforge_infra.teardown_guard import (
    LocalDvcRemote,
    StoredCheckpoint,
    checkpoint_safety,
    guard,
)
from tests.support.records import run_record
from tests.support.sshd import free_port

DVC = Path(sys.executable).with_name("dvc")


def checkpoint(**changes) -> StoredCheckpoint:
    values = dict(
        host="w0",
        launch_id="20260101-000000-abcdef12",
        run_id="run-0123456789ab",
        tag="step-00000100",
        path="/scratch/x",
        retained=None,
        md5={"a.pt": "0" * 32},
    )
    return StoredCheckpoint(**{**values, **changes})


# -- the rule ------------------------------------------------------------------------------------
def test_a_checkpoint_on_retained_storage_is_safe():
    assert checkpoint_safety(checkpoint(retained="/workspace/checkpoints", md5=None), None).safe


def test_a_checkpoint_elsewhere_without_a_remote_is_not():
    verdict = checkpoint_safety(checkpoint(), None)
    assert (
        not verdict.safe and "no DVC remote" in verdict.reason and "step-00000100" in verdict.reason
    )


def test_latest_naming_a_missing_checkpoint_is_not_safe():
    verdict = checkpoint_safety(checkpoint(problem="`latest` names step-2, which is missing"), None)
    assert not verdict.safe and "missing" in verdict.reason


@pytest.fixture
def pushed(tmp_path) -> tuple[Path, Path]:
    """A DVC repository whose default remote holds, after a real `dvc push`, a checkpoint's
    files; returns (the checkpoint, the remote)."""
    if not DVC.exists():
        pytest.skip("dvc is not installed next to this Python")
    repo, remote = tmp_path / "repo", tmp_path / "remote"
    repo.mkdir()
    tag_dir = write_run(repo, "r1", 100)
    env = {**os.environ, "PATH": f"{DVC.parent}{os.pathsep}{os.environ['PATH']}"}
    for command in (
        ["git", "init", "-q"],
        [str(DVC), "init", "-q"],
        [str(DVC), "remote", "add", "-d", "store", str(remote)],
        [str(DVC), "add", "-q", str(tag_dir.relative_to(repo))],
        [str(DVC), "push", "-q"],
    ):
        subprocess.run(command, cwd=repo, env=env, check=True, capture_output=True)
    return tag_dir, remote


def test_a_checkpoint_whose_files_are_all_in_the_remote_is_safe(pushed, tmp_path):
    """Its md5s, as the worker computes them, are found in the remote `dvc push` filled; one file
    missing there (an interrupted push) makes it unsafe again."""
    tag_dir, remote = pushed
    (entry,) = newest_checkpoints([str(tag_dir.parents[6])], retained=[])
    stored = StoredCheckpoint(host="w0", **entry)
    assert checkpoint_safety(stored, LocalDvcRemote(remote)).safe
    objects = sorted(
        p for p in (remote / "files" / "md5").rglob("*") if p.is_file() and p.suffix != ".dir"
    )
    objects[0].unlink()
    verdict = checkpoint_safety(stored, LocalDvcRemote(remote))
    assert not verdict.safe and "1 of its 2 files" in verdict.reason


# -- what a worker lists -------------------------------------------------------------------------
def test_a_worker_lists_the_newest_checkpoint_of_each_run_with_its_real_place(tmp_path):
    """Runs under a root (a checkout's checkpoints/, a multi-node run's shared ones): each
    training run's `latest`, its real path (the symlink into the retained volume resolved)."""
    volume, scratch = tmp_path / "volume", tmp_path / "scratch"
    on_volume = write_run(volume / "clipforge-runs", "r1", 200, shared=True)
    (scratch).mkdir()
    (scratch / "runs").symlink_to(volume / "clipforge-runs" / "runs")
    off_volume = write_run(tmp_path / "elsewhere", "r2", 50)
    entries = newest_checkpoints(
        [str(scratch), str(tmp_path / "elsewhere")], retained=[str(volume)]
    )
    by_run = {e["launch_id"]: e for e in entries}
    assert by_run["r1"]["path"] == str(on_volume) and by_run["r1"]["retained"] == str(volume)
    assert by_run["r2"]["tag"] == "step-00000050" and by_run["r2"]["retained"] is None
    assert set(by_run["r2"]["md5"]) == {"global_step/mp_rank_00_model_states.pt", "zero_to_fp32.py"}
    assert off_volume.is_dir()


# -- the stack, through SSH ----------------------------------------------------------------------
@pytest.fixture
def worker(sshd, tmp_path, monkeypatch):
    """The outputs of a one-worker stack (this machine), reached from inside the cluster with the
    user's default key; the stack's retained checkpoints volume, a directory here."""
    home = tmp_path / "laptop"
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(sshd.client_key, home / ".ssh" / "id_ed25519")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CLIPFORGE_SSH_GATEWAY", "none")
    volume = tmp_path / "volumes" / "checkpoints"
    volume.mkdir(parents=True)
    forget_roots(sshd)
    return stack_outputs(sshd, volume), volume


def test_runs_on_the_retained_volume_let_make_down_go_ahead(worker, tmp_path, capsys):
    """A run under the default root on the checkpoints volume: released, each checkpoint named."""
    outputs, volume = worker
    write_run(volume / "clipforge-runs", "r1", 200)
    assert guard(outputs, tmp_path, force=False, command="make down STACK=mine")
    out = capsys.readouterr().out
    assert "r1" in out and "on retained storage" in out


def test_a_run_off_retained_storage_stops_make_down(worker, sshd, tmp_path, capsys):
    """A run whose root (recorded by its launch) is on the worker's own disk, no DVC remote:
    refused, naming the run, its checkpoint and the command that would override."""
    outputs, _ = worker
    write_run(tmp_path / "worker-disk", "r2", 70)
    record_root(sshd, tmp_path / "worker-disk")
    (tmp_path / "laptop-repo").mkdir()
    assert not guard(outputs, tmp_path / "laptop-repo", force=False, command="make down STACK=mine")
    err = capsys.readouterr().err
    assert "refusing to release the GPUs" in err and "r2" in err and "step-00000070" in err
    assert "`make down STACK=mine FORCE=1`" in err
    assert guard(outputs, tmp_path / "laptop-repo", force=True, command="make down STACK=mine")
    assert "releasing anyway" in capsys.readouterr().err


def test_an_unreachable_worker_stops_make_down(worker, tmp_path, capsys):
    """A worker the guard cannot reach cannot be checked: refused, naming it."""
    outputs, _ = worker
    outputs["ssh"]["port"] = free_port()
    assert not guard(outputs, tmp_path, force=False, command="make down STACK=mine")
    assert "cannot check the checkpoints on worker 127.0.0.1" in capsys.readouterr().err


def test_a_stack_without_workers_has_nothing_to_lose(tmp_path, capsys):
    """Never brought up, or already released: nothing to check, whatever lies on this machine
    (a demo's checkpoints/ in the checkout is not on the stack)."""
    write_run(tmp_path, "demo", 93)
    assert guard({}, tmp_path, force=False, command="make down STACK=mine")
    assert guard({"released": True, "workers": []}, tmp_path, False, "make down STACK=mine")
    assert "nothing to lose" in capsys.readouterr().out


def test_a_run_whose_store_lacks_its_newest_checkpoint_stops_make_down_until_it_is_there(
    worker, sshd, s3, tmp_path, capsys
):
    """A run on the worker's own disk with a run store (moto's S3 on 127.0.0.1) that has not
    taken its newest checkpoint yet: refused, naming the store; once the store holds the
    checkpoint whole (files, manifest, marker), the release goes ahead."""
    outputs, _ = worker
    remote = s3.new_bucket() + "/runs"
    checkpoint_dir = write_run(tmp_path / "worker-disk", "r3", 90)
    run_dir = tmp_path / "worker-disk" / "runs" / "r3"
    (run_dir / "run.json").write_text(run_record(params={"storage": {"remote": remote}}).to_json())
    record_root(sshd, tmp_path / "worker-disk")
    (tmp_path / "laptop-repo").mkdir()
    assert not guard(outputs, tmp_path / "laptop-repo", force=False, command="make down STACK=mine")
    err = capsys.readouterr().err
    assert f"is not in the run store {remote} yet" in err and "step-00000090" in err

    write_manifest(checkpoint_dir)
    store = RunStore(remote, checkpoint_dir.parent.name)
    store.upload_checkpoint(checkpoint_dir)
    store.publish(checkpoint_dir.name)
    assert guard(outputs, tmp_path / "laptop-repo", force=False, command="make down STACK=mine")
    assert f"is in the run store {remote}" in capsys.readouterr().out


# -- a stack of runMode jobs ---------------------------------------------------------------------
def jobs_stack_outputs() -> dict:
    """The outputs `make up` writes for an example stack with runMode jobs (no workers)."""
    config, secret_keys = stack_config("example-1x4", {"runMode": "jobs"})
    return json.loads(json.dumps(run_program(config, secret_keys).outputs))


def test_a_jobs_stack_lets_make_down_go_ahead_its_runs_being_on_the_retained_volume(
    tmp_path, capsys
):
    """No worker to ask: a run's pods keep its run root on the checkpoints volume, which the
    outputs say is retained, so `make down` goes ahead, saying so and how to list the runs'
    Jobs it leaves running."""
    outputs = jobs_stack_outputs()
    assert guard(outputs, tmp_path, force=False, command="make down STACK=mine")
    out = capsys.readouterr().out
    assert "clipforge-checkpoints, /workspace/checkpoints), retained" in out
    assert "kubectl -n clipforge get jobs -l clipforge/launch-id" in out


def test_a_jobs_stack_whose_checkpoints_volume_is_not_retained_stops_make_down(tmp_path, capsys):
    outputs = jobs_stack_outputs()
    outputs["volumes"]["checkpoints"]["retained"] = False
    assert not guard(outputs, tmp_path, force=False, command="make down STACK=mine")
    err = capsys.readouterr().err
    assert "refusing to release the GPUs: runs as Jobs keep their checkpoints" in err
    assert "make down STACK=mine FORCE=1" in err
