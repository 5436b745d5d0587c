"""A SIGKILLed supervisor of a real `fab train` run on a real sshd: its keeper starts a new one,
which adopts the live trainer, and the run ends finished with eval run, no command typed and
every logged step there once. With the keeper killed too, `fab status` says the trainer trains
on, and `fab train --resume` adopts it instead of colliding with it (and with DVC's lock)."""

from __future__ import annotations

import os
import signal

import pytest

from clipforge.launcher.host.processes import keeper_pid, supervisor_pid
from clipforge.launcher.host.run_dirs import NodeLayout
from tests.launcher.conftest import RUN_SETS, launch_run, set_args
from tests.support.run_curves import event_steps, tsv_steps
from tests.support.wait import wait_for

# Real runs through `fab` (minutes each): in make test-tier2. make test keeps the claims on
# stand-in phases (test_supervisor_keeper.py).
pytestmark = [pytest.mark.slow, pytest.mark.tier2]


def _layout(run) -> NodeLayout:
    return NodeLayout.of_node_dir(str(run.node_dir))


def _training(run) -> dict | None:
    """The state once the trainer has logged a step (and a checkpoint is not far)."""
    state = run.state()
    return state if state.get("phase") == "train" and len(tsv_steps(run.code)) >= 2 else None


def _assert_finished_with_every_step_once(run, final: dict) -> None:
    log = (run.node_dir / "train.log").read_text()
    supervisor = [line for line in log.splitlines() if "clipforge supervisor" in line]
    assert final["state"] == "finished", (final, supervisor)
    assert "is busy" not in log  # no second `dvc exp run` met the first one's lock
    assert (run.code / "metrics" / "eval.json").is_file()
    assert tsv_steps(run.code) == list(range(1, 9))
    assert event_steps(run.code) == list(range(1, 9))


def test_a_killed_supervisor_is_replaced_and_the_run_finishes(fab, sshd, remote_root):
    run = launch_run(fab, sshd, remote_root, *set_args(RUN_SETS))
    first = wait_for(lambda: _training(run), what="a step logged", timeout=900)
    os.kill(first["supervisor_pid"], signal.SIGKILL)
    final = run.wait_finished(timeout=900)
    _assert_finished_with_every_step_once(run, final)
    assert final["restarts"] == 0 and final["supervisor_pid"] != first["supervisor_pid"]
    status = run.run_fab("status").stdout
    assert f"replaced 1x by its keeper; the last, pid {first['supervisor_pid']}" in status, status


# The keeper killed too, on a real run: make test-tier3. make test keeps the same on a stand-in
# trainer (host/test_keeper.py); tier2 the supervisor replaced by its keeper (above).
@pytest.mark.tier3
def test_with_its_keeper_killed_too_status_tells_and_a_resume_adopts_the_trainer(
    fab, sshd, remote_root
):
    run = launch_run(fab, sshd, remote_root, *set_args(RUN_SETS))
    first = wait_for(lambda: _training(run), what="a step logged", timeout=900)
    keeper = keeper_pid(_layout(run))
    assert keeper is not None
    os.kill(keeper, signal.SIGSTOP)  # frozen first, so that it cannot replace the supervisor
    os.kill(first["supervisor_pid"], signal.SIGKILL)
    os.kill(keeper, signal.SIGKILL)
    wait_for(
        lambda: keeper_pid(_layout(run)) is None and supervisor_pid(_layout(run)) is None,
        what="the keeper and the supervisor gone",
        timeout=60,
    )
    status = run.run_fab("status").stdout
    assert f"lost: supervisor pid {first['supervisor_pid']} gone" in status, status
    assert f"trainer pid {first['child_pid']} still training at step " in status, status

    resumed = run.run_fab("train", "--resume", run.launch_id)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    final = run.wait_finished(timeout=900)
    _assert_finished_with_every_step_once(run, final)
    log = (run.node_dir / "train.log").read_text()
    assert f"attempt 1 (pid {first['child_pid']}) adopted" in log
