"""`fab ... --runtime docker` against a real Docker engine, with the CPU image the project builds.

A private dockerd (tests/support/dockerd.py) serves a host reached through its own sshd on
127.0.0.1, whose sessions get DOCKER_HOST; the image is `make image-cpu`'s (docker/build-cpu.sh,
cached by a hash of its inputs in the engine's persistent data root). The SSH user is root, so the
containers run as the image's own non-root user. About 15 minutes for a cold image build, then a
few minutes: run by `make test-integration` (and .ci/run), skipped by `make test`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.launcher.conftest import RUN_SETS, LaunchedRun, make_fab, set_args, wait_for_end
from tests.support.dockerd import DockerUnavailable, start_dockerd
from tests.support.sshd import start_sshd
from tests.support.webhooks import SECRET

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("CLIPFORGE_DOCKER_TESTS") != "1",
        reason="a real Docker engine and the CPU image: `make test-integration`",
    ),
]


class Engine:
    """The private engine, which a test may take away and bring back."""

    def __init__(self) -> None:
        self.engine = start_dockerd()

    def docker(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.engine.docker(*args, check=check)

    def restart(self) -> None:
        self.engine.stop()
        self.engine = start_dockerd()


@pytest.fixture(scope="module")
def engine():
    try:
        holder = Engine()
    except DockerUnavailable as exc:
        pytest.fail(f"no Docker engine: {exc}")
    yield holder
    holder.engine.stop()


@pytest.fixture(scope="module")
def cpu_image(engine) -> str:
    result = subprocess.run(
        [str(REPO / "docker" / "build-cpu.sh")],
        env={**os.environ, **engine.engine.env, "PYTHON": str(REPO / ".venv" / "bin" / "python")},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reference = result.stdout.strip().splitlines()[-1]
    # The data root persists between sessions: drop CPU images of older inputs (GBs each).
    listed = engine.docker("images", "--format", "{{.Repository}}:{{.Tag}}", "clipforge-cpu")
    stale = [name for name in listed.stdout.split() if name != reference]
    if stale:
        engine.docker("rmi", *stale)
    engine.docker("container", "prune", "--force")  # e.g. a failed build's
    engine.docker("image", "prune", "--force")
    return reference


@pytest.fixture(scope="module")
def docker_host(engine, tmp_path_factory):
    """An sshd whose sessions use the private engine (as a host's own docker would be)."""
    server = start_sshd(
        tmp_path_factory.mktemp("docker-sshd"),
        set_env={"DOCKER_HOST": f"unix://{engine.engine.socket}"},
    )
    yield server
    server.stop()


def _fab(project, docker_host, base: Path):
    return make_fab(project, base / "home", base / "remote", docker_host)


def _launch(fab, docker_host, root: Path, image: str, *extra: str, env: dict) -> LaunchedRun:
    result = fab(
        "train",
        "--gpus",
        "0",
        "--runtime",
        "docker",
        "--data",
        "build",
        "--image",
        image,
        *extra,
        *set_args(RUN_SETS),
        hosts=docker_host.address,
        key=docker_host.client_key,
        env=env,
        timeout=900,
    )
    return LaunchedRun(fab, docker_host, root, result)


def wait_for_hold(run: LaunchedRun) -> None:
    """Until the checkpoint of step 2 is saved: step 3 then holds (CLIPFORGE_FAULTS=hold@3)."""

    def latest() -> str | None:
        markers = list((run.code / "checkpoints").glob("run-*/latest"))
        return markers[0].read_text().strip() if markers else None

    run.wait_until(lambda: latest() == "step-00000002", what="the checkpoint of step 2")


def _containers(engine, run_id: str) -> list[str]:
    listed = engine.docker(
        "ps", "-a", "--format", "{{.Names}}", "--filter", f"name=clipforge-{run_id}-"
    )
    return listed.stdout.split()


@pytest.fixture(scope="module")
def held_run(engine, cpu_image, docker_host, project, tmp_path_factory, webhook_module):
    """`fab train --runtime docker --smoke`, held at step 3 (a stop releases it)."""
    base = tmp_path_factory.mktemp("docker-run")
    run = _launch(
        _fab(project, docker_host, base),
        docker_host,
        base / "remote",
        cpu_image,
        "--smoke",
        env={"CLIPFORGE_FAULTS": "hold@3", "CLIPFORGE_ALERT_WEBHOOKS": webhook_module.url()},
    )
    wait_for_hold(run)
    run.container = f"clipforge-{run.launch_id}-n0-train"
    return run


@pytest.fixture(scope="module")
def webhook_module():
    from tests.support.webhooks import WebhookServer

    server = WebhookServer()
    server.start()
    yield server
    server.stop()


def test_training_runs_in_the_image_as_its_non_root_user_with_its_entrypoint(engine, held_run):
    """The train phase is a container of the CPU image: tini + the real entrypoint, uid 1000."""
    info = json.loads(engine.docker("inspect", held_run.container).stdout)[0]
    assert info["Config"]["Entrypoint"] == [
        "/usr/bin/tini",
        "--",
        "/usr/local/bin/clipforge-entrypoint",
    ]
    assert info["Config"]["User"] == "1000:1000"
    uid = engine.docker("exec", held_run.container, "id", "-u").stdout.strip()
    assert uid == "1000"
    log = (held_run.node_dir / "train.log").read_text()
    assert "clipforge image:" in log and "torch 2.1.2" in log  # the entrypoint's report


def test_the_webhook_secret_reaches_the_container_by_name_only(engine, held_run, webhook_module):
    """The stage inside alerted the webhook (run started), yet `docker inspect` has no value."""
    assert any("run_started" in json.dumps(r.body) for r in webhook_module.wait_for(1))
    inspect = engine.docker("inspect", held_run.container).stdout
    assert SECRET not in inspect and "CLIPFORGE_ENV_FROM_STDIN" in inspect


def test_status_and_logs_read_the_containers_run(held_run):
    status = held_run.run_fab("status")
    assert status.returncode == 0, status.stderr
    assert "running" in status.stdout and "docker" in status.stdout
    logs = held_run.run_fab("logs", "--lines", "20")
    assert logs.returncode == 0 and "Checkpoint step-00000002 is ready" in logs.stdout


def test_stop_resume_and_fetch_leave_no_container(engine, held_run, tmp_path):
    """`fab stop` checkpoints and stops; `--resume` finishes (the smoke check passes); `fab fetch`
    brings the results home; no container of the run is left, running or not."""
    stop = held_run.run_fab("stop")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert held_run.state()["state"] == "stopped" and "step-00000003" in stop.stdout
    assert _containers(engine, held_run.launch_id) == []
    resumed = held_run.run_fab("train", "--resume", held_run.launch_id)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert held_run.wait_finished()["state"] == "finished"
    assert json.loads((held_run.node_dir / "smoke.json").read_text())["passed"] is True
    fetched = held_run.run_fab("fetch", "--to", str(tmp_path))
    assert fetched.returncode == 0, fetched.stderr
    assert (
        tmp_path / held_run.launch_id / "models" / "clip" / "open_clip_model.safetensors"
    ).exists()
    assert _containers(engine, held_run.launch_id) == []


def test_check_passes_against_the_engine_and_fails_clearly_without_one(
    cpu_image, docker_host, project, tmp_path
):
    """`fab check --runtime docker`: ok against the engine and the image; a host whose docker
    reaches no engine fails the docker row, saying so."""
    fab = _fab(project, docker_host, tmp_path)
    args = ("check", "--runtime", "docker", "--gpus", "0", "--image", cpu_image)
    good = fab(*args, hosts=docker_host.address, key=docker_host.client_key)
    assert good.returncode == 0, good.stdout + good.stderr
    assert f"{cpu_image} present" in good.stdout
    nowhere = start_sshd(
        tmp_path / "no-engine", set_env={"DOCKER_HOST": "unix:///nonexistent.sock"}
    )
    try:
        fab = make_fab(project, tmp_path / "home2", tmp_path / "remote2", nowhere)
        bad = fab(*args, hosts=nowhere.address, key=nowhere.client_key)
    finally:
        nowhere.stop()
    assert bad.returncode == 1
    assert "docker not usable" in bad.stdout and "Cannot connect to the Docker daemon" in bad.stdout


def test_the_engine_going_away_mid_run_exhausts_the_restarts_and_alerts(
    engine, cpu_image, docker_host, project, tmp_path, webhook
):
    """dockerd stops during a step: the supervisor restarts the phase with back-off as for any
    crash, each attempt fails to reach the engine, and after --max-restarts it gives up with a
    line saying so and a run_failed alert."""
    run = _launch(
        _fab(project, docker_host, tmp_path),
        docker_host,
        tmp_path / "remote",
        cpu_image,
        "--max-restarts",
        "2",
        env={"CLIPFORGE_FAULTS": "hold@3", "CLIPFORGE_ALERT_WEBHOOKS": webhook.url()},
    )
    wait_for_hold(run)
    engine.engine.stop()
    try:
        final = wait_for_end(run.node_dir)
    finally:
        engine.restart()
    assert final["state"] == "failed" and final["restarts"] == 2
    assert "2 restarts used of 2" in final["reason"]
    log = (run.node_dir / "train.log").read_text()
    assert "Cannot connect to the Docker daemon" in log
    assert any("run_failed" in json.dumps(r.body) for r in webhook.received)
