"""Fewer GPUs, same run: a real 2-rank CPU run under the supervisor loses "GPU 1" mid-run (the
fault hook says it no longer answers, and its rank dies, as a GPU falling off the bus kills
it). The restart goes on with one rank from the last checkpoint, saved by two (loaded through
DeepSpeed's universal checkpoint), with the same global batch and run id, and ends where an
uninterrupted 2-rank run ends: the loss step by step, and the weights within fp32 round-off."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from clipforge.launcher.host.gpus import FAULT_FILE
from clipforge.launcher.host.plan import Phase, PhasePlan, RestartPolicy
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.status import collect, summarize
from clipforge.launcher.host.supervisor import MODULE
from clipforge.progress import read_progress
from tests.conftest import TWO_RANK_SETS, subprocess_env, train_command
from tests.support.records import run_record
from tests.support.same_run import assert_same_run
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.tier2]
# The run of tests/conftest.py's two_rank_run (12 steps, a checkpoint every 4, the loss of every
# step logged), here under a supervisor that loses a GPU.


def _latest(checkpoints: Path) -> str | None:
    found = [p.read_text().strip() for p in checkpoints.glob("run-*/latest")]
    return found[0] if found else None


def test_a_lost_gpu_mid_run_the_run_goes_on_with_one_rank_and_ends_where_two_end(
    tmp_path, small_data, two_rank_run, webhook
):
    reference = two_rank_run
    lost = tmp_path / "lost"
    node = NodeLayout(root=str(lost), launch_id="run", node_rank=0)
    Path(node.node_dir).mkdir(parents=True)
    Path(node.record).write_text(run_record(gpus_per_node=2).to_json())
    release = lost / "release"
    # Step 6 waits for `release`: rank 1 dies after the checkpoint of step 4, whatever the speed
    # of this machine; the restart finds `release` there and goes on.
    phase = Phase(
        name="train",
        argv=train_command(lost, small_data, TWO_RANK_SETS),
        cwd=str(lost),
        env={"CLIPFORGE_FAULTS": f"wait@6={release}"},
    )
    policy = RestartPolicy(
        max_restarts=2, backoff_seconds=0.1, backoff_max_seconds=0.2, stop_timeout_seconds=60
    )
    Path(node.plan).write_text(PhasePlan(phases=[phase], policy=policy).to_json())
    supervisor = subprocess.Popen(
        [sys.executable, "-m", MODULE, "run", node.node_dir],
        env={**subprocess_env(), "CLIPFORGE_ALERT_WEBHOOKS": webhook.url()},
        cwd=node.node_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        checkpoints = lost / "checkpoints"
        wait_for(
            lambda: _latest(checkpoints) == "step-00000004",
            what="the checkpoint of step 4",
            timeout=1200,
        )
        wait_for(
            lambda: len(read_progress(node.progress_dir)) == 2,
            what="both ranks' heartbeats",
            timeout=600,
        )
        (Path(node.node_dir) / FAULT_FILE).write_text("0\n")  # GPU 1 no longer answers...
        (rank_1,) = [p for p in read_progress(node.progress_dir) if p.rank == 1]
        os.kill(rank_1.pid, signal.SIGKILL)  # ...and its rank is gone with it
        release.touch()
        assert supervisor.wait(timeout=2400) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()

    state = json.loads(Path(node.state).read_text())
    log = Path(node.train_log).read_text()
    assert state["state"] == "finished" and state["restarts"] == 1, log[-3000:]
    assert (state["gpus"]["ranks"], state["gpus"]["ranks_before"]) == (2 // 2, 2)
    (run_dir,) = checkpoints.iterdir()  # one run id across the world-size change
    assert (reference / "checkpoints" / run_dir.name).is_dir()
    assert "loading it through DeepSpeed's universal checkpoint" in log
    assert f"resuming {run_dir.name} at step 4/12" in log
    assert "batch 32 = 16 micro x 2 accum x 1 ranks" in log
    (alert,) = [r.body for r in webhook.wait_for(1) if r.body["rule"] == "gpu_lost"]
    assert alert["host"] == socket.gethostname()
    assert "GPU 1 of 2 no longer answers" in alert["message"]
    assert "(ranks 2 -> 1)" in alert["message"]
    assert dict(summarize(collect(node), None))["GPUs"].endswith(
        "going on with 1 of 2 ranks on GPU 0 (2 -> 1)"
    )

    # Step by step: the two runs are the same run until the loss (steps 1-4: bit for bit, the
    # same two ranks), then the same maths on one rank.
    assert_same_run(reference, lost, steps=12, exact_through=4)
