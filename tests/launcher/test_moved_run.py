"""A run that outlives its host through the run store (storage.remote: moto's S3 server on
127.0.0.1, s3fs as the client). Its first host dies mid-run (every process killed, its run
directory lost) once the store holds a checkpoint; `fab train --resume RUN` on a host that never
saw the run finds the launch in the store, ships the run's commit there, and the train stage
resumes from the store's checkpoint to the weights of the uninterrupted run (the smoke run's
training). "Another host" is another run root behind the same sshd: nothing of the first one is
left to be found there."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal

import pytest

from tests.launcher.conftest import RUN_SETS, launch_run, make_fab, set_args, wait_for_end
from tests.launcher.hostprocs import processes_under

pytestmark = pytest.mark.slow
HELD_STEP = 5  # of the 8 of RUN_SETS: the first host holds there until it dies
STORED_STEP = 4  # the checkpoint (saved every 2 steps) the store has when the host dies


def _store_latest(fs, remote: str) -> str | None:
    markers = fs.glob(remote.removeprefix("s3://") + "/*/checkpoints/latest")
    fs.invalidate_cache()
    return fs.cat_file(markers[0]).decode().strip() if markers else None


def _digests(directory):
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def moved_run(project, sshd, s3_server, tmp_path_factory):
    base = tmp_path_factory.mktemp("moved-run")
    remote = s3_server.new_bucket() + "/runs"
    fs = s3_server.filesystem()
    first_root = base / "host-a"
    first = make_fab(project, base / "home-a", first_root, sshd)
    run = launch_run(
        first,
        sshd,
        first_root,
        *set_args([*RUN_SETS, f"storage.remote={remote}"]),
        env={**s3_server.env, "CLIPFORGE_FAULTS": f"hold@{HELD_STEP}"},
    )
    run.wait_until(
        lambda: _store_latest(fs, remote) == f"step-{STORED_STEP:08d}", what="checkpoint stored"
    )
    for pid in processes_under(first_root):  # the box dies: no stop, no last upload
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(first_root)

    second_root = base / "host-b"
    run.second = make_fab(project, base / "home-b", second_root, sshd)
    run.remote = remote
    run.move = run.second(
        "train",
        "--resume",
        run.run_id,
        "--store",
        remote,
        hosts=sshd.address,
        key=sshd.client_key,
        env=s3_server.env,
    )
    assert run.move.returncode == 0, run.move.stdout + run.move.stderr
    run.moved_node = second_root / "runs" / run.run_id / "node-0"
    run.final = wait_for_end(run.moved_node)
    return run


def test_a_run_moved_to_a_new_host_resumes_from_the_store_to_the_same_weights(moved_run, smoke_run):
    """On a host that never saw it, `fab train --resume RUN` starts the run under its id from the
    store's checkpoint; it ends with the metrics and exported weights of the uninterrupted run."""
    assert "moving it there from" in moved_run.move.stdout
    assert moved_run.final["state"] == "finished", (moved_run.moved_node / "train.log").read_text()[
        -3000:
    ]
    code = moved_run.moved_node / "code"
    info = json.loads((code / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == STORED_STEP
    summary = json.loads((code / "metrics" / "train.json").read_text())
    assert summary == json.loads((smoke_run.code / "metrics" / "train.json").read_text())
    assert _digests(code / "models" / "clip") == _digests(smoke_run.code / "models" / "clip")


def test_a_run_neither_on_the_host_nor_in_the_store_is_refused_in_one_line(moved_run, sshd):
    """`fab train --resume` of an id the store does not know: one line naming the host and the
    store; nothing is started."""
    result = moved_run.second(
        "train",
        "--resume",
        "20990101-000000-deadbeef",
        "--store",
        moved_run.remote,
        hosts=sshd.address,
        key=sshd.client_key,
    )
    assert result.returncode != 0
    assert "has no launch of that id" in result.stderr and "Traceback" not in result.stderr
