"""`fab train --nodes 2`: one DeepSpeed launcher per node (no-SSH mode), really run.

The two "nodes" are this machine reached under two host names (127.0.0.1 and localhost) through
the same sshd, sharing the run root as real nodes share the checkpoints volume; one CPU rank each,
so DeepSpeed's process group spans the two launchers (gloo over TCP).
"""

from __future__ import annotations

import json

import pytest

from tests.launcher.conftest import RUN_SETS, LaunchedRun, make_fab, set_args, wait_for_end
from tests.launcher.sshd import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_node_run(project, sshd, tmp_path_factory):
    base = tmp_path_factory.mktemp("two-nodes")
    fab = make_fab(project, base / "home", base / "remote", sshd)
    kind, blob = sshd.host_public_key.split()[:2]
    with open(base / "home" / ".ssh" / "known_hosts", "a") as known:
        known.write(f"[localhost]:{sshd.port} {kind} {blob}\n")
    hosts = f"{sshd.address},{sshd.user}@localhost:{sshd.port}"
    # 32 = 16 per micro-batch x 2 ranks (one per node) x 1 accumulation step.
    result = fab(
        "train",
        "--gpus",
        "0",
        "--nodes",
        "2",
        "--runtime",
        "host",
        "--data",
        "build",
        "--master-port",
        str(free_port()),
        *set_args(RUN_SETS),
        hosts=hosts,
        key=sshd.client_key,
    )
    run = LaunchedRun(fab, sshd, base / "remote", result)
    run.hosts = hosts
    run.node1 = run.root / "runs" / run.run_id / "node-1"
    run.final_state = run.wait_finished()
    # node 1's supervisor records its end a moment after node 0's, on its own
    run.node1_state = wait_for_end(run.node1)
    return run


def test_every_node_runs_its_own_launcher_and_the_run_finishes(two_node_run):
    """Both nodes' supervisors finish; node 0 wrote the metrics of a world of two ranks."""
    assert two_node_run.final_state["state"] == "finished", (
        two_node_run.node_dir / "train.log"
    ).read_text()[-3000:]
    assert two_node_run.node1_state["state"] == "finished", (
        two_node_run.node1 / "train.log"
    ).read_text()[-3000:]
    info = json.loads((two_node_run.code / "metrics" / "train.info.json").read_text())
    assert info["steps"] == 8
    log0 = (two_node_run.node_dir / "train.log").read_text()
    assert "1 micro x" not in log0 and "x 2 ranks" in log0


def test_checkpoints_are_shared_by_the_nodes(two_node_run):
    """The checkpoint holds both ranks' optimizer shards, in the run's shared directory."""
    shared = two_node_run.root / "runs" / two_node_run.run_id / "checkpoints"
    latest = next(shared.glob("run-*/latest"))
    step_dir = latest.parent / latest.read_text().strip()
    shards = sorted(p.name for p in step_dir.glob("*optim_states.pt"))
    assert len(shards) == 2, shards


def test_status_covers_every_node(two_node_run):
    """`fab status` with both hosts: node 0's progress, and node 1's state."""
    result = two_node_run.fab("status", hosts=two_node_run.hosts, key=two_node_run.sshd.client_key)
    assert result.returncode == 0, result.stderr
    assert "2 nodes x CPU" in result.stdout and "node 1: finished" in result.stdout
