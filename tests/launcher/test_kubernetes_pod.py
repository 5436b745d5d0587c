"""The pod of a `fab train --kubernetes` run, executed here: its rendered command and environment
run as a process on this machine (CPU ranks, the built-in data, a local run store), with the
stack's volumes and the run's ConfigMaps as folders. The first pod dies (every process killed,
as a lost node takes them) once the store holds a checkpoint; its replacement, the same command
and environment again, finds the run on the checkpoints "volume", resumes and ends with the
weights of the uninterrupted run (the smoke run's training, as in test_moved_run.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from clipforge.launcher.source import current_source
from clipforge.store.remote import read_launch
from tests.support.hostprocs import processes_under
from tests.support.k8spod import Pod, render_cpu_run, stored_step
from tests.support.same_run import exported_weights
from tests.support.wait import still_running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.tier2]
STORED_STEP = 4  # of RUN_SETS' 8, saved every 2: in the store when the first pod dies
WAIT_STEP = 5  # the first pod waits there (CLIPFORGE_FAULTS wait@) until the test lets it go


@pytest.fixture(scope="module")
def replaced_pod(project, tmp_path_factory):
    base = tmp_path_factory.mktemp("k8s-pod")
    run = render_cpu_run(project, base, 1, WAIT_STEP)
    launch_id, objects, store, go = run.launch_id, run.objects, run.store, run.go
    pod = Pod(objects, base / "run-files", base)
    first = pod.start("first")
    try:
        wait_for(
            lambda: stored_step(store) == f"step-{STORED_STEP:08d}",
            what="a checkpoint in the run store",
            timeout=900,
            check=still_running(first, lambda: pod.output("first")),
        )
    finally:  # the node is lost: every process of the pod killed, nothing said to them
        for pid in processes_under(run.checkpoints):
            os.kill(pid, signal.SIGKILL)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    go.touch()  # the fault is the first pod's: its replacement goes past that step
    second = pod.start("second")
    code = second.wait(timeout=900)
    node = run.checkpoints / "clipforge-runs" / "runs" / launch_id / "node-0"
    return {"code": code, "node": node, "pod": pod, "store": store, "launch_id": launch_id}


def test_a_replacement_pod_resumes_the_run_to_the_weights_of_the_uninterrupted_run(
    replaced_pod, smoke_run
):
    """The replacement pod's supervisor finishes the run from the checkpoint of the lost pod;
    the metrics and exported weights are those of the run that was never interrupted."""
    node = replaced_pod["node"]
    assert replaced_pod["code"] == 0, replaced_pod["pod"].output("second")
    state = json.loads((node / "state.json").read_text())
    assert state["state"] == "finished", (node / "train.log").read_text()[-3000:]
    code = node / "code"
    info = json.loads((code / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == STORED_STEP
    summary = json.loads((code / "metrics" / "train.json").read_text())
    assert summary == json.loads((smoke_run.code / "metrics" / "train.json").read_text())
    assert exported_weights(code / "models" / "clip") == exported_weights(
        smoke_run.code / "models" / "clip"
    )


def test_the_run_s_checkout_and_launch_record_are_where_the_ssh_path_puts_them(
    replaced_pod, project
):
    """The node's checkout is at the launch's commit (the shipped bundle removed), and the run
    record reached the run store, where `fab status --run` and `fab train --resume` read it."""
    node, launch_id = replaced_pod["node"], replaced_pod["launch_id"]
    head = subprocess.run(
        ["git", "-C", str(node / "code"), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    assert head.stdout.strip() == current_source(project).commit
    assert not (node / "code.bundle").exists()
    record = read_launch(str(replaced_pod["store"]), launch_id)
    assert record and record["launch_id"] == launch_id and record["runtime"] == "host"
