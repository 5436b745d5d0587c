"""The supervisor on its own, with shell commands standing for the train stage (seconds each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from clipforge.launcher.host.plan import Phase, PhasePlan, RestartPolicy
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.supervisor import MODULE
from tests.conftest import REPO
from tests.support.hostprocs import processes_under
from tests.support.records import run_record
from tests.support.wait import wait_for


def _node(root: Path) -> NodeLayout:
    """The one node of a run under `root`; the phases' shell commands work in `root` itself."""
    return NodeLayout(root=str(root), launch_id="run", node_rank=0)


def _supervisor(command: str, root: Path, env: dict | None = None, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", MODULE, command, _node(root).node_dir],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **kwargs,
    )


def _supervise(
    root: Path,
    *phases: Phase,
    max_restarts: int = 3,
    wait: bool = True,
    env: dict | None = None,
    min_gpus: int | None = None,
):
    node = _node(root)
    Path(node.node_dir).mkdir(parents=True, exist_ok=True)
    policy = RestartPolicy(
        max_restarts=max_restarts,
        backoff_seconds=0.1,
        backoff_max_seconds=0.2,
        stop_timeout_seconds=30,
        min_gpus=min_gpus,
    )
    Path(node.plan).write_text(PhasePlan(phases=list(phases), policy=policy).to_json())
    process = _supervisor("run", root, env, cwd=node.node_dir)
    if wait:
        process.wait(timeout=120)
    return process


def _state(root: Path) -> dict:
    return json.loads(Path(_node(root).state).read_text())


def _log(root: Path) -> str:
    return Path(_node(root).train_log).read_text()


def _sh(name: str, script: str, cwd: Path, restartable: bool = True) -> Phase:
    return Phase(name=name, argv=["sh", "-c", script], cwd=str(cwd), restartable=restartable)


def test_failed_phase_is_restarted_until_it_succeeds(tmp_path):
    """A phase failing twice is restarted twice, each exit recorded; then the next phase runs."""
    script = 'n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count; [ "$n" -ge 2 ]'
    process = _supervise(
        tmp_path, _sh("train", script, tmp_path), _sh("after", "touch done", tmp_path)
    )
    state = _state(tmp_path)
    assert process.returncode == 0 and state["state"] == "finished"
    assert state["restarts"] == 2 and [e["code"] for e in state["exits"]] == [1, 1]
    assert (tmp_path / "done").exists()
    log = _log(tmp_path)
    assert "restart 1/3" in log and "restart 2/3" in log


def test_gives_up_after_max_restarts(tmp_path):
    """A phase that always fails: max_restarts restarts, then `failed` and a non-zero exit."""
    process = _supervise(tmp_path, _sh("train", "exit 7", tmp_path), max_restarts=2)
    state = _state(tmp_path)
    assert process.returncode == 1 and state["state"] == "failed"
    assert state["restarts"] == 2 and len(state["exits"]) == 3
    assert "giving up" in _log(tmp_path)


def test_the_same_rendezvous_error_twice_gives_up_at_once_with_an_alert(tmp_path, webhook):
    """Two attempts in a row ending on the same rendezvous error (ports differ, as they do): the
    supervisor gives up after the second, with restarts left, says why and alerts the webhook."""
    script = (
        'n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count; echo "RuntimeError: '
        "Gloo connectFullMesh failed with ... SO_ERROR: Connection refused, "
        'remote=[127.0.0.1]:2652$n"; exit 1'
    )
    process = _supervise(
        tmp_path,
        _sh("train", script, tmp_path),
        max_restarts=5,
        env={"CLIPFORGE_ALERT_WEBHOOKS": webhook.url()},
    )
    state = _state(tmp_path)
    assert process.returncode == 1 and state["state"] == "failed"
    assert state["restarts"] == 1 and (tmp_path / "count").read_text() == "2\n"
    assert "the same rendezvous error twice in a row" in state["reason"]
    alert = webhook.wait_for(1)[0].body
    assert "run_failed" in json.dumps(alert) and "connectFullMesh" in json.dumps(alert)
    # the launch's id under its own name; no training run id, as none saved a checkpoint
    assert (alert["launch_id"], alert["run_id"]) == ("run", None)
    assert "delivered" in _log(tmp_path)


def test_a_rendezvous_error_once_is_restarted_as_any_crash(tmp_path):
    """A rendezvous error followed by another kind of failure is not a repeat: restarts go on."""
    script = (
        "n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count; "
        'if [ "$n" = 0 ]; then echo "DistNetworkError: failed to connect to 10.0.0.1:29500"; '
        'elif [ "$n" = 1 ]; then echo "CUDA error: an illegal memory access"; fi; [ "$n" -ge 2 ]'
    )
    process = _supervise(tmp_path, _sh("train", script, tmp_path), max_restarts=5)
    assert process.returncode == 0 and _state(tmp_path)["restarts"] == 2


def test_stop_request_interrupts_the_phase_and_restarts_nothing(tmp_path):
    """`supervisor stop`: the phase gets SIGINT (it checkpoints and exits 143, like the stage),
    the run ends `stopped`, and the later phases never run."""
    script = (
        "trap 'echo saved > checkpoint; exit 143' INT; touch started; while :; do sleep 0.1; done"
    )
    process = _supervise(
        tmp_path, _sh("train", script, tmp_path), _sh("after", "touch after", tmp_path), wait=False
    )
    wait_for(lambda: (tmp_path / "started").exists(), what="the phase starting", timeout=120)
    assert _supervisor("stop", tmp_path).wait(timeout=60) == 0
    process.wait(timeout=60)
    state = _state(tmp_path)
    assert process.returncode == 0 and state["state"] == "stopped" and state["restarts"] == 0
    assert (tmp_path / "checkpoint").read_text() == "saved\n"
    assert not (tmp_path / "after").exists()


def test_leftovers_of_a_crashed_attempt_are_killed_before_the_restart(tmp_path):
    """A crashed attempt's orphaned children (ranks, loader workers) do not outlive it."""
    script = (
        "if [ ! -e crashed ]; then touch crashed; (cd leftover && exec sleep 300) & exit 1; fi; "
        "true"
    )
    (tmp_path / "leftover").mkdir()
    process = _supervise(tmp_path, _sh("train", script, tmp_path))
    assert process.returncode == 0 and _state(tmp_path)["restarts"] == 1
    assert processes_under(tmp_path / "leftover") == []


def test_a_directory_that_is_no_run_node_is_refused(tmp_path):
    """NODE_DIR must read <root>/runs/<run>/node-<rank>: anything else is refused, saying so."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    result = subprocess.run(
        [sys.executable, "-m", MODULE, "run", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "runs/<run>/node-<rank>" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_backoff_doubles_up_to_its_cap():
    """Delays before restarts 1, 2, 3, 4: 30 s doubling each time, never above the cap."""
    policy = RestartPolicy(
        max_restarts=5, backoff_seconds=30, backoff_max_seconds=100, stop_timeout_seconds=1
    )
    assert [policy.delay_before(n) for n in (1, 2, 3, 4)] == [30, 60, 100, 100]


# A stand-in for one rank: beats like the stage's ranks do; on its first attempt, after two
# beats, it stops itself (SIGSTOP, as a wedged process), on the next it finishes.
_HUNG_RANK = """
import os, signal, sys, time
from clipforge.progress import ProgressFile
progress = ProgressFile.from_environment(0, float(sys.argv[1]))
first = not os.path.exists("attempted")
open("attempted", "a").close()
for step in (1, 2):
    progress.beat(step)
    time.sleep(1.1)  # one write per second at most: the second beat is written too
if first:
    os.kill(os.getpid(), signal.SIGSTOP)
progress.close(2)
"""


def test_a_hung_rank_is_dumped_alerted_killed_and_restarted(tmp_path, webhook):
    """A rank silent for its stall timeout (here: stopped): the supervisor writes its stack into
    the run's log, sends a `hang` alert, kills the attempt and restarts it; the restart
    finishes. The exit is recorded as a hang."""
    phase = Phase(
        name="train",
        argv=[sys.executable, "-c", _HUNG_RANK, "2"],
        cwd=str(tmp_path),
        env={"PYTHONPATH": str(REPO / "src")},
    )
    process = _supervise(tmp_path, phase, env={"CLIPFORGE_ALERT_WEBHOOKS": webhook.url()})
    state = _state(tmp_path)
    assert process.returncode == 0 and state["state"] == "finished"
    assert state["restarts"] == 1 and "no training step for" in state["exits"][0]["hang"]
    log = _log(tmp_path)
    assert "dumping the stacks of every rank" in log and "stacks of rank 0" in log
    assert 'File "<string>"' in log  # faulthandler's dump of the stopped rank's main thread
    assert "hung and was killed; restart 1/3" in log
    (alert,) = [r.body for r in webhook.wait_for(1) if r.body["rule"] == "hang"]
    assert alert["severity"] == "critical" and "rank 0" in alert["message"]


# A stand-in for a rank in set-up: it beats as the train stage's set-up does (each part with
# alerts.setup_timeout_seconds, argv[1]); on its first attempt it stops itself while "loading
# the checkpoint", before any step, as a rank on a dead mount would; on the next it finishes.
_HUNG_IN_SET_UP = """
import os, signal, sys
from clipforge.progress import ProgressFile, SetUpProgress
setup = SetUpProgress.from_environment(float(sys.argv[1]))
setup.part("building the model")
first = not os.path.exists("attempted")
open("attempted", "a").close()
setup.part("loading the checkpoint")
if first:
    os.kill(os.getpid(), signal.SIGSTOP)
ProgressFile.from_environment(0, 60.0).close(0)
"""


def test_a_rank_hung_in_set_up_is_a_hang_on_its_own_budget(tmp_path, webhook):
    """Before its first step a rank is watched too, on alerts.setup_timeout_seconds: stopped
    while loading the checkpoint, it is dumped, alerted and restarted like a rank hung in a
    step, and the exit says where it hung and which setting ran out."""
    phase = Phase(
        name="train",
        argv=[sys.executable, "-c", _HUNG_IN_SET_UP, "2"],
        cwd=str(tmp_path),
        env={"PYTHONPATH": str(REPO / "src")},
    )
    process = _supervise(tmp_path, phase, env={"CLIPFORGE_ALERT_WEBHOOKS": webhook.url()})
    state = _state(tmp_path)
    assert process.returncode == 0 and state["state"] == "finished", _log(tmp_path)[-2000:]
    hang = state["exits"][0]["hang"]
    assert "no progress while loading the checkpoint for" in hang
    assert "last step none" in hang and "alerts.setup_timeout_seconds=2" in hang
    assert 'File "<string>"' in _log(tmp_path)  # the stopped rank's stack, from faulthandler
    (alert,) = [r.body for r in webhook.wait_for(1) if r.body["rule"] == "hang"]
    assert "loading the checkpoint" in alert["message"]


# A stand-in for a rank whose master is cut off: every attempt stops while joining the process
# group, as a rank whose link went down waits there (before torch's own timeout would say so).
_HUNG_JOINING = """
import os, signal, sys
from clipforge.progress import JOINING_PROCESS_GROUP, SetUpProgress
with open("count", "a") as f:
    f.write("x")
SetUpProgress.from_environment(float(sys.argv[1])).part(JOINING_PROCESS_GROUP)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_hanging_twice_in_a_row_while_joining_the_process_group_gives_up(tmp_path):
    """A hang while joining the process group is a rendezvous failure: the second in a row ends
    the run with restarts left, saying a restart cannot fix it, instead of using every one."""
    phase = Phase(
        name="train",
        argv=[sys.executable, "-c", _HUNG_JOINING, "2"],
        cwd=str(tmp_path),
        env={"PYTHONPATH": str(REPO / "src")},
    )
    process = _supervise(tmp_path, phase, max_restarts=5)
    state = _state(tmp_path)
    assert process.returncode == 1 and state["state"] == "failed", _log(tmp_path)[-2000:]
    assert state["restarts"] == 1 and (tmp_path / "count").read_text() == "xx"
    assert "the same rendezvous error twice in a row" in state["reason"]
    assert "no progress while joining the process group" in state["reason"]


# A stand-in for the eval stage: it beats without a timeout of its own (it reads no alerts:)
# and stops itself on its first attempt; the supervisor applies the run's stall timeout.
_HUNG_EVAL = """
import os, signal
from clipforge.progress import ProgressFile
progress = ProgressFile.from_environment(0, None)
progress.beat(None, "evaluating")
first = not os.path.exists("attempted")
open("attempted", "a").close()
if first:
    os.kill(os.getpid(), signal.SIGSTOP)
progress.close(None)
"""


def test_a_hung_eval_is_a_hang_on_the_runs_stall_timeout(tmp_path):
    """The eval phase beats without a budget of its own: silent for the run's
    alerts.stall_timeout_seconds (from its record's params) it is a hang, restarted."""
    node = _node(tmp_path)
    Path(node.node_dir).mkdir(parents=True)
    Path(node.record).write_text(
        run_record(params={"alerts": {"stall_timeout_seconds": 2}}).to_json()
    )
    phase = Phase(
        name="eval",
        argv=[sys.executable, "-c", _HUNG_EVAL],
        cwd=str(tmp_path),
        env={"PYTHONPATH": str(REPO / "src")},
    )
    process = _supervise(tmp_path, phase)
    state = _state(tmp_path)
    assert process.returncode == 0 and state["state"] == "finished", _log(tmp_path)[-2000:]
    assert "no progress while evaluating for" in state["exits"][0]["hang"]
    assert "alerts.stall_timeout_seconds=2" in state["exits"][0]["hang"]
