"""A GPU that is gone: found before an attempt (nvidia-smi's answer, or the CPU fault hook),
alerted as `gpu_lost` with host, device and ranks before -> after, shown by `fab status`. The
run goes on with the GPUs left, down to `--min-gpus`; below it, it stops with the reason instead
of spending every restart on the same failure; once the GPU is back, the next attempt uses it."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from clipforge.launcher.host.gpus import (
    FAULT_FILE,
    Inventory,
    attempt_argv,
    attempt_env,
    default_min_gpus,
    judge,
    parse_indices,
    ranks_for,
)
from clipforge.launcher.host.plan import Phase
from clipforge.launcher.host.status import collect, summarize
from tests.launcher.host.test_supervisor import _log, _node, _state, _supervise
from tests.support.records import run_record


def test_nvidia_smi_answers_are_read_with_error_lines_mixed_in():
    text = "0\nUnable to determine the device handle for GPU 0000:3B:00.0: Unknown Error\n2\n3\n"
    assert parse_indices(text) == (0, 2, 3)
    assert parse_indices("1,0") == (0, 1)


def test_the_ranks_left_keep_the_global_batch_and_the_floor_is_half_rounded_up():
    """A divisor of the planned count: the global batch then splits with the same micro batch."""
    assert [ranks_for(8, left) for left in (8, 7, 6, 5, 4, 3, 2, 1)] == [8, 4, 4, 4, 4, 2, 2, 1]
    assert [ranks_for(6, left) for left in (5, 4, 3)] == [3, 3, 3]
    assert [default_min_gpus(n) for n in (1, 2, 3, 4, 8)] == [1, 1, 2, 2, 4]


def test_judge_goes_on_with_the_gpus_left_down_to_the_floor():
    ok = judge(4, Inventory((0, 1, 2, 3), "nvidia-smi"), min_gpus=2)
    assert ok.can_continue and ok.lost == () and ok.devices == (0, 1, 2, 3)
    one = judge(4, Inventory((0, 2, 3), "nvidia-smi"), min_gpus=2)
    assert one.lost == (1,) and one.devices == (0, 2) and one.ranks == 2
    assert "GPU 1 of 4 no longer answers (nvidia-smi): going on with 2 rank(s)" in one.message
    assert "1 more answers but would not keep the global batch" in one.message
    three = judge(4, Inventory((3,), "nvidia-smi"), min_gpus=2)
    assert not three.can_continue and three.devices == ()
    assert "GPU 0, GPU 1, GPU 2 of 4" in three.message
    assert "fewer than --min-gpus=2" in three.message


def test_an_attempt_on_fewer_gpus_names_them_to_the_host_command_or_the_container():
    assert attempt_env(1, (2,)) == {
        "CLIPFORGE_RANKS_PER_NODE": "1",
        "CUDA_VISIBLE_DEVICES": "2",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    host = ["python", "-m", "clipforge.train"]
    assert attempt_argv(host, 2, (0, 2)) == host
    docker = ["docker", "run", "--rm", "--gpus", "4", "--ulimit", "memlock=-1", "image", "cmd"]
    assert attempt_argv(docker, 2, (0, 2)) == [
        "docker",
        "run",
        "--env",
        "CLIPFORGE_RANKS_PER_NODE=2",
        "--rm",
        "--gpus",
        '"device=0,2"',
        *("--ulimit", "memlock=-1", "image", "cmd"),
    ]


# The first attempt "loses" GPU 1 (as a GPU falling off the bus would) and crashes; later ones
# write down what they were given and succeed.
_CRASH_AND_LOSE = f"""
import os, pathlib, sys
node = pathlib.Path({{node!r}})
if not (node / "attempted").exists():
    (node / "attempted").touch()
    (node / {FAULT_FILE!r}).write_text("0\\n")
    sys.exit(1)
given = {{{{k: os.environ.get(k) for k in ("CLIPFORGE_RANKS_PER_NODE", "CUDA_VISIBLE_DEVICES")}}}}
(node / "given.json").write_text(__import__("json").dumps(given))
"""


def _lose_gpu_1(tmp_path):
    node = _node(tmp_path)
    Path(node.node_dir).mkdir(parents=True)
    Path(node.record).write_text(run_record(launch_id="run", gpus_per_node=2).to_json())
    script = _CRASH_AND_LOSE.format(node=node.node_dir)
    return node, Phase(name="train", argv=[sys.executable, "-c", script], cwd=str(tmp_path))


def test_a_lost_gpu_below_min_gpus_alerts_stops_the_run_and_shows_in_status(tmp_path, webhook):
    node, phase = _lose_gpu_1(tmp_path)
    process = _supervise(
        tmp_path, phase, env={"CLIPFORGE_ALERT_WEBHOOKS": webhook.url()}, min_gpus=2
    )
    state = _state(tmp_path)
    assert process.returncode == 1 and state["state"] == "failed"
    assert len(state["exits"]) == 1, "no attempt is spent on a GPU that is gone"
    assert "attempt 2" not in _log(tmp_path)
    gpus = state["gpus"]
    assert (gpus["planned"], gpus["usable"], gpus["lost"], gpus["ranks"]) == (2, [0], [1], 0)
    assert gpus["source"] == str(Path(node.node_dir) / FAULT_FILE)
    assert "GPU 1 of 2 no longer answers" in state["reason"]
    assert "fewer than --min-gpus=2" in state["reason"]
    rules = [r.body["rule"] for r in webhook.wait_for(2)]
    assert rules == ["gpu_lost", "run_failed"]
    alert = webhook.received[0].body
    assert alert["host"] == socket.gethostname() and "GPU 1" in alert["message"]
    assert "(ranks 2 -> 0)" in alert["message"]
    rows = dict(summarize(collect(node), None))
    assert rows["GPUs"].startswith("lost GPU 1 of 2")
    assert rows["GPUs"].endswith("below --min-gpus=2: stopped")
    assert rows["state"].startswith("failed: GPU 1 of 2")
    assert "phase train cannot start; giving up" in _log(tmp_path)

    # The GPU is back (reset, replaced): the next supervisor of the run trains again, on both.
    (Path(node.node_dir) / FAULT_FILE).write_text("0\n1\n")
    assert _supervise(tmp_path, phase).returncode == 0
    assert _state(tmp_path)["state"] == "finished" and _state(tmp_path)["gpus"]["lost"] == []
    given = json.loads((Path(node.node_dir) / "given.json").read_text())
    assert given == {"CLIPFORGE_RANKS_PER_NODE": None, "CUDA_VISIBLE_DEVICES": None}


def test_a_lost_gpu_the_run_goes_on_with_fewer_ranks_then_uses_it_again(tmp_path, webhook):
    """Default --min-gpus (half of 2: 1): the restart runs one rank on GPU 0, alerted once."""
    node, phase = _lose_gpu_1(tmp_path)
    process = _supervise(tmp_path, phase, env={"CLIPFORGE_ALERT_WEBHOOKS": webhook.url()})
    state = _state(tmp_path)
    assert process.returncode == 0 and state["state"] == "finished", _log(tmp_path)[-2000:]
    assert state["restarts"] == 1
    given = json.loads((Path(node.node_dir) / "given.json").read_text())
    assert given == {"CLIPFORGE_RANKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "0"}
    assert (state["gpus"]["ranks"], state["gpus"]["ranks_before"]) == (1, 2)
    (alert,) = [r.body for r in webhook.wait_for(1)]
    assert alert["rule"] == "gpu_lost" and alert["severity"] == "warning"
    assert alert["host"] == socket.gethostname()
    assert "GPU 1 of 2 no longer answers" in alert["message"]
    assert "going on with 1 rank(s) on GPU 0" in alert["message"]
    assert "(ranks 2 -> 1)" in alert["message"]
    rows = dict(summarize(collect(node), None))
    assert rows["GPUs"] == (
        f"lost GPU 1 of 2 (found by {Path(node.node_dir) / FAULT_FILE}); 1 answer; "
        f"going on with 1 of 2 ranks on GPU 0 (2 -> 1)"
    )

    # Back: the next supervisor (a resume) runs the whole node again, and says so.
    (Path(node.node_dir) / FAULT_FILE).write_text("0\n1\n")
    assert _supervise(tmp_path, phase).returncode == 0
    given = json.loads((Path(node.node_dir) / "given.json").read_text())
    assert given == {"CLIPFORGE_RANKS_PER_NODE": None, "CUDA_VISIBLE_DEVICES": None}
    state = _state(tmp_path)
    assert (state["gpus"]["ranks"], state["gpus"]["ranks_before"]) == (2, 1)
    assert dict(summarize(collect(node), None))["GPUs"] == (
        "all 2 answer again: back to 2 ranks (1 -> 2)"
    )
    assert "all 2 GPU(s) answer" in _log(tmp_path)


def test_min_gpus_is_checked_against_the_gpus_of_a_node():
    from clipforge.errors import LauncherError
    from clipforge.launcher.options import make_options

    def options(**kwargs):
        common = dict(nodes=1, sets=[], smoke=False, runtime="host", allow_dirty=False)
        return make_options(data="build", **common, **kwargs)

    assert options(gpus=8, min_gpus=4).min_gpus == 4
    assert options(gpus=8).min_gpus is None  # the supervisor's default: half
    with pytest.raises(LauncherError, match=r"^--min-gpus: got 0; must be >= 1$"):
        options(gpus=8, min_gpus=0)  # the restart policy's own rule (host.plan.RestartLimits)
    with pytest.raises(LauncherError, match=r"--min-gpus: 1\.\.--gpus \(8\)"):
        options(gpus=8, min_gpus=9)
