"""`fab train --gpus 0 --smoke --runtime host` through a real sshd, and the tasks that watch it."""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import struct
import subprocess
import threading
import urllib.request

import pytest
import yaml

from tests.support.sshd import free_port
from tests.support.wait import still_running, wait_for

pytestmark = pytest.mark.slow


def test_train_says_how_to_watch_the_run_one_command_a_line(smoke_run):
    """After `started run ID`: the watch and stop commands, each whole on its own line with the
    user's -H and -i (no ` | ` between them, which read as shell pipes)."""
    lines = smoke_run.launch.stdout.splitlines()
    started = next(i for i, line in enumerate(lines) if line.startswith("started run "))
    fab = f"fab -H {smoke_run.sshd.address} -i {smoke_run.sshd.client_key} "
    assert [line.split(fab)[1] for line in lines[started + 1 : started + 5]] == [
        "status --watch",
        "logs --follow",
        "tensorboard",
        "stop",
    ]


def test_smoke_saves_a_checkpoint_and_loads_it_back(smoke_run):
    """The smoke run trains, then the stage reloads its final checkpoint and re-exports the same
    weights."""
    smoke = json.loads((smoke_run.node_dir / "smoke.json").read_text())
    assert smoke["passed"], smoke["checks"]
    assert set(smoke["checks"]) == {
        "resume command exited 0",
        "resumed from the final checkpoint",
        "same run id after reload",
        "exported weights identical after reload",
    }
    assert smoke["trained"]["steps"] == 8 and smoke["trained"]["resumed_from_step"] == 0


def test_the_run_record_names_commit_params_image_and_host(smoke_run, project, sshd):
    """run.json on the host: the shipped commit (checked out there), resolved params, image, host."""
    record = json.loads((smoke_run.root / "runs" / smoke_run.launch_id / "run.json").read_text())
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=project, capture_output=True, text=True
    ).stdout.strip()
    assert record["commit"] == head
    checked_out = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=smoke_run.code, capture_output=True, text=True
    ).stdout.strip()
    assert checked_out == head
    assert (
        record["params"]["train"]["max_steps"] == 8 and record["params"]["train"]["device"] == "cpu"
    )
    assert record["image"].startswith("clipforge:") and record["hosts"] == [sshd.address]
    resolved = yaml.safe_load(
        (smoke_run.root / "runs" / smoke_run.launch_id / "params.resolved.yaml").read_text()
    )
    assert resolved["train"] == record["params"]["train"]


def test_what_the_run_writes_is_group_readable_at_most_and_its_export_has_one_mode(smoke_run):
    """On a shared host (the SSH session's umask 022): no folder of the run, and no file the run
    writes (record, plan, state, logs, checkpoints, metrics, curves, the export), lets other users
    in or the group write; every file of the exported model has the same mode. (Files a library
    chmods itself, DVC's read-only cache and the checkout DVC restores, sit in those folders.)"""
    run_dir = smoke_run.root / "runs" / smoke_run.launch_id
    code = smoke_run.code
    written = [
        *run_dir.glob("*.*"),
        *smoke_run.node_dir.glob("*.*"),
        *[
            p
            for name in ("checkpoints", "logs", "metrics", "models")
            for p in (code / name).rglob("*")
        ],
    ]
    folders = [p for p in [run_dir, *run_dir.rglob("*")] if p.is_dir() and not p.is_symlink()]
    too_open = {
        str(p.relative_to(run_dir)): oct(p.stat().st_mode & 0o777)
        for p in [*folders, *written]
        if p.stat().st_mode & 0o027
    }
    assert not too_open, too_open
    assert {p.name for p in written} >= {
        "run.json",
        "state.json",
        "train.log",
        "latest",
        "eval.json",
    }
    model = code / "models" / "clip"
    assert {p.stat().st_mode & 0o777 for p in model.rglob("*") if p.is_file()} == {0o640}


def test_status_shows_the_finished_run(smoke_run):
    """`fab status` (--watch: once, the run having ended): run id, state, step/total, loss,
    restarts, and the next step with the user's -H and -i."""
    result = smoke_run.run_fab("status", "--watch")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert smoke_run.launch_id in out and "finished" in out
    assert "8/8" in out and "restarts" in out and "0/5" in out
    assert "(final)" in out  # the final loss from metrics/train.json
    assert "smoke" in out and "passed" in out
    sshd = smoke_run.sshd
    assert out.splitlines()[-1] == (
        f"next: fab -H {sshd.address} -i {sshd.client_key} fetch --launch {smoke_run.launch_id}"
    )


def test_logs_show_the_stage_and_supervisor_output(smoke_run):
    """`fab logs`: the train stage's lines and the supervisor's phase lines."""
    result = smoke_run.run_fab("logs", "--lines", "400")
    assert result.returncode == 0, result.stderr
    assert "clipforge.train" in result.stdout and "phase train attempt 1" in result.stdout
    assert "smoke: PASSED" in result.stdout


def test_fetch_brings_metrics_model_and_logs_home(smoke_run, tmp_path):
    """`fab fetch`: metrics, the exported model and TensorBoard logs arrive locally, as on the
    host, and the run's DVC experiment under its launch id, marked smoke."""
    result = smoke_run.run_fab("fetch", "--to", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr
    name = f"{smoke_run.launch_id}-smoke"
    assert f"experiment {name}: `dvc exp show` lists it" in result.stdout
    refs = subprocess.run(
        ["git", "for-each-ref", "--format=%(refname)", "refs/exps"],
        cwd=smoke_run.fab.project,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert any(ref.endswith(f"/{name}") for ref in refs), refs
    home = tmp_path / "runs" / smoke_run.launch_id
    assert json.loads((home / "metrics" / "train.json").read_text()) == json.loads(
        (smoke_run.code / "metrics" / "train.json").read_text()
    )
    remote_model = smoke_run.code / "models" / "clip"
    files = sorted(p.relative_to(remote_model) for p in remote_model.rglob("*") if p.is_file())
    assert files and all(
        _sha(home / "models" / "clip" / f) == _sha(remote_model / f) for f in files
    )
    assert list((home / "logs").glob("*-run-*/events.out.tfevents.*"))
    assert (home / "node-0" / "run.json").is_file() and (home / "node-0" / "train.log").is_file()


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tensorboard_serves_the_run_through_an_ssh_forward(smoke_run):
    """`fab tensorboard`: TensorBoard on the host, reached at the printed local URL through the
    SSH port-forward; Ctrl-C stops fab (exit 130) and that TensorBoard quietly, even after a
    browser reset a connection (Fabric's tunnel thread met the reset), and even when fab started
    with SIGINT ignored, as a command started with & in a script does (as here under .ci/run)."""
    port = free_port()
    # fab inherits SIGINT ignored, as a command a script starts with & does
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process = smoke_run.fab.popen(
            "tensorboard",
            "--port",
            str(port),
            hosts=smoke_run.sshd.address,
            key=smoke_run.sshd.client_key,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}/"
    wait_for(
        lambda: any(url in line for line in lines),
        what=f"tensorboard serving {url}",
        interval=0.2,
        check=still_running(process, lambda: "".join(lines)),
    )
    try:
        with urllib.request.urlopen(url + "data/runs", timeout=60) as response:
            runs = json.loads(response.read())
        assert any("-run-" in name for name in runs), runs
        dropped = socket.create_connection(("127.0.0.1", port))
        dropped.sendall(b"GET /data/runs HTTP/1.1\r\nHost: x\r\n\r\n")
        dropped.recv(1)  # the response has started
        dropped.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        dropped.close()  # with linger 0: a reset
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=300)  # a loaded machine: stopping goes over SSH
    reader.join(timeout=60)
    assert process.returncode == 130 and "Traceback" not in "".join(lines), lines
    assert [line for line in lines if line.strip()] == [next(x for x in lines if url in x)]
    assert not (smoke_run.node_dir / "tensorboard.pid").exists()
