"""A GPU that is gone: found before an attempt (nvidia-smi's answer, or the CPU fault hook),
alerted as `gpu_lost` with host and device, shown by `fab status`, and the run stops with the
reason instead of spending every restart on the same failure; once the GPU is back, a resumed
supervisor runs again."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from clipforge.launcher.host.gpus import FAULT_FILE, Inventory, judge, parse_indices
from clipforge.launcher.host.plan import Phase
from clipforge.launcher.host.status import collect, summarize
from tests.launcher.test_supervisor import _log, _node, _state, _supervise
from tests.support.records import run_record


def test_nvidia_smi_answers_are_read_with_error_lines_mixed_in():
    text = "0\nUnable to determine the device handle for GPU 0000:3B:00.0: Unknown Error\n2\n3\n"
    assert parse_indices(text) == (0, 2, 3)
    assert parse_indices("1,0") == (0, 1)


def test_judge_names_the_lost_devices_and_the_floor():
    ok = judge(4, Inventory((0, 1, 2, 3), "nvidia-smi"), min_gpus=2)
    assert ok.can_continue and ok.lost == ()
    one = judge(4, Inventory((0, 2, 3), "nvidia-smi"), min_gpus=2)
    assert not one.can_continue and one.lost == (1,)
    assert "GPU 1 of 4 no longer answers (nvidia-smi)" in one.message
    three = judge(4, Inventory((3,), "nvidia-smi"), min_gpus=2)
    assert (
        "GPU 0, GPU 1, GPU 2 of 4" in three.message and "fewer than --min-gpus=2" in three.message
    )


# The first attempt "loses" GPU 1 (as a GPU falling off the bus would) and crashes.
_CRASH_AND_LOSE = f"""
import pathlib, sys
pathlib.Path({{node!r}}, {FAULT_FILE!r}).write_text("0\\n")
sys.exit(1)
"""


def test_a_lost_gpu_alerts_stops_the_run_and_shows_in_status(tmp_path, webhook):
    node = _node(tmp_path)
    Path(node.node_dir).mkdir(parents=True)
    Path(node.record).write_text(run_record(launch_id="run", gpus_per_node=2).to_json())
    script = _CRASH_AND_LOSE.format(node=node.node_dir)
    phase = Phase(name="train", argv=[sys.executable, "-c", script], cwd=str(tmp_path))
    process = _supervise(tmp_path, phase, env={"CLIPFORGE_ALERT_WEBHOOKS": webhook.url()})
    state = _state(tmp_path)
    assert process.returncode == 1 and state["state"] == "failed"
    assert len(state["exits"]) == 1, "no attempt is spent on a GPU that is gone"
    assert "attempt 2" not in _log(tmp_path)
    assert state["gpus"] == {
        "planned": 2,
        "usable": [0],
        "lost": [1],
        "source": str(Path(node.node_dir) / FAULT_FILE),
    }
    assert "GPU 1 of 2 no longer answers" in state["reason"]
    rules = [r.body["rule"] for r in webhook.wait_for(2)]
    assert rules == ["gpu_lost", "run_failed"]
    alert = webhook.received[0].body
    assert alert["host"] == socket.gethostname() and "GPU 1" in alert["message"]
    rows = dict(summarize(collect(node), None))
    assert rows["GPUs"].startswith("lost GPU 1 of 2")
    assert rows["state"].startswith("failed: GPU 1 of 2")
    assert "phase train cannot start; giving up" in _log(tmp_path)

    # The GPU is back (reset, replaced): the next supervisor of the run trains again.
    (Path(node.node_dir) / FAULT_FILE).write_text("0\n1\n")
    done = Phase(name="train", argv=["true"], cwd=str(tmp_path))
    assert _supervise(tmp_path, done).returncode == 0
    assert _state(tmp_path)["state"] == "finished" and _state(tmp_path)["gpus"]["lost"] == []
