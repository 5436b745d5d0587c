"""The supervisor is supervised: started by `supervisor launch` under its keeper, a supervisor
killed with SIGKILL is replaced at once, and the new one adopts the attempt the dead one left
running (it is never started twice); with the keeper killed too, `fab status` says the trainer
runs on, and a `launch` (what `fab train --resume` runs) adopts it. Shell commands stand for the
stages (seconds each); the real thing through `fab` is test_supervisor_killed.py (tier2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from clipforge.launcher.host.plan import PhasePlan, RestartPolicy
from clipforge.launcher.host.processes import keeper_pid, supervisor_pid
from clipforge.launcher.host.status import collect, summarize
from clipforge.launcher.host.supervisor import MODULE
from tests.conftest import REPO
from tests.launcher.host.test_supervisor import _log, _node, _sh, _state
from tests.support.wait import wait_for

# The "trainer": refuses (and says so in `raced`) to start beside a running one, counts its
# starts, says it runs, and ends once released.
TRAINER = (
    "if [ -e running ]; then touch raced; exit 4; fi; "
    "n=$(cat starts 2>/dev/null || echo 0); echo $((n+1)) > starts; touch running; "
    "while [ ! -e release ]; do sleep 0.1; done; rm running"
)


def _launch(root: Path) -> subprocess.CompletedProcess:
    """`supervisor launch NODE_DIR`, as `fab train` (and `--resume`) runs it on the host."""
    return subprocess.run(
        [sys.executable, "-m", MODULE, "launch", _node(root).node_dir],
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        input="{}",
        capture_output=True,
        text=True,
        timeout=60,
    )


def _plan(root: Path) -> None:
    node = _node(root)
    Path(node.node_dir).mkdir(parents=True)
    policy = RestartPolicy(
        max_restarts=2, backoff_seconds=0.1, backoff_max_seconds=0.2, stop_timeout_seconds=30
    )
    phases = [_sh("train", TRAINER, root), _sh("eval", "touch evaluated", root)]
    Path(node.plan).write_text(PhasePlan(phases=phases, policy=policy).to_json())


def _running(root: Path) -> dict | None:
    """The state once the trainer runs under a live supervisor."""
    node = _node(root)
    if not (root / "running").exists() or supervisor_pid(node) is None:
        return None
    state = _state(root)
    return state if state["state"] == "running" and state["child_pid"] else None


def _ended(root: Path) -> dict | None:
    state = _state(root) if Path(_node(root).state).exists() else {}
    return state if state.get("state") in ("finished", "failed", "stopped") else None


def test_a_killed_supervisor_is_replaced_and_the_new_one_adopts_the_live_trainer(tmp_path):
    _plan(tmp_path)
    node = _node(tmp_path)
    assert _launch(tmp_path).returncode == 0
    first = wait_for(lambda: _running(tmp_path), what="the trainer running", timeout=120)
    keeper = keeper_pid(node)
    assert keeper is not None

    os.kill(first["supervisor_pid"], signal.SIGKILL)

    def replaced() -> dict | None:
        state = _running(tmp_path)
        return state if state and state["supervisor_pid"] != first["supervisor_pid"] else None

    second = wait_for(replaced, what="a new supervisor watching the trainer", timeout=120)
    assert second["child_pid"] == first["child_pid"] and second["attempt"] == 1
    rows = dict(summarize(collect(node), None))
    assert rows["state"].startswith("running (phase train, attempt 1)")
    assert f"pid {first['supervisor_pid']}" in rows["supervisor"]
    assert "(signal SIGKILL), its attempt adopted" in rows["supervisor"]
    # A second launch (a `fab train --resume`) while it is live: one line naming the supervisor.
    again = _launch(tmp_path)
    assert again.returncode == 3 and again.stderr.count("\n") == 1
    assert f"its supervisor (pid {second['supervisor_pid']}) is running it" in again.stderr

    (tmp_path / "release").touch()
    final = wait_for(lambda: _ended(tmp_path), what="the run ending", timeout=120)
    assert final["state"] == "finished" and final["restarts"] == 0 and final["exits"] == []
    assert (tmp_path / "starts").read_text() == "1\n" and (tmp_path / "evaluated").exists()
    assert not (tmp_path / "raced").exists()
    assert "adopted: supervisor pid" in _log(tmp_path)
    wait_for(lambda: keeper_pid(node) is None, what="the keeper ending with the run", timeout=60)


def test_with_the_keeper_gone_too_status_says_the_trainer_runs_and_a_resume_adopts_it(tmp_path):
    _plan(tmp_path)
    node = _node(tmp_path)
    assert _launch(tmp_path).returncode == 0
    first = wait_for(lambda: _running(tmp_path), what="the trainer running", timeout=120)
    keeper = keeper_pid(node)
    assert keeper is not None
    os.kill(keeper, signal.SIGKILL)
    os.kill(first["supervisor_pid"], signal.SIGKILL)
    # SIGKILL lands when the killed process is next scheduled: wait for both, not just one.
    wait_for(
        lambda: keeper_pid(node) is None and supervisor_pid(node) is None,
        what="the keeper and the supervisor gone",
        timeout=60,
    )

    info = collect(node)
    state = dict(summarize(info, None))["state"]
    assert info["state"]["state"] == "lost" and info["attempt_alive"] == first["child_pid"]
    assert state.startswith(f"lost: supervisor pid {first['supervisor_pid']} gone (last heard")
    assert f"; trainer pid {first['child_pid']} still training at step 0;" in state
    assert "`fab train --resume ID` starts a supervisor, which adopts the trainer" in state

    assert _launch(tmp_path).returncode == 0  # what `fab train --resume` runs on the host
    wait_for(
        lambda: (
            (_running(tmp_path) or {}).get("supervisor_pid") not in (None, first["supervisor_pid"])
        ),
        what="the resumed supervisor adopting the trainer",
        timeout=120,
    )
    (tmp_path / "release").touch()
    final = wait_for(lambda: _ended(tmp_path), what="the run ending", timeout=120)
    # Nobody recorded the old trainer's exit (its keeper was gone): taken as a failure, so the
    # phase runs once more, after it ended (the train stage would resume from its checkpoint).
    assert final["state"] == "finished" and final["restarts"] == 1, _log(tmp_path)
    assert (tmp_path / "starts").read_text() == "2\n" and not (tmp_path / "raced").exists()
    assert "ended with no status recorded" in _log(tmp_path)
