"""Supervision: a killed training process is restarted from its checkpoint; `fab stop` stops a
run gracefully and `fab train --resume` carries it on. Compared with the uninterrupted training
of the smoke run (same params, same data: the same train run id)."""

from __future__ import annotations

import json
import os
import re
import signal
import uuid

import pytest

from clipforge.train.reporting import COLUMNS
from tests.conftest import git
from tests.launcher.conftest import RUN_SETS, launch_run, make_fab, set_args
from tests.support.hostprocs import (
    environment_of,
    files_containing,
    processes_under,
    train_stage_process,
)
from tests.support.run_curves import event_steps, tsv_steps
from tests.support.same_run import exported_weights

# Two real runs through `fab` (a minute and a half): in make test-tier2 (.ci/run). make test keeps
# restart, stop and resume on stand-in phases (test_supervisor.py) and a real run launched,
# watched and fetched through `fab` (test_smoke_run.py).
pytestmark = [pytest.mark.slow, pytest.mark.tier2]
# Nothing listens on port 9 here: alerts the stage sends to it fail at once (and are only logged).
SECRET = f"http://127.0.0.1:9/hook/{uuid.uuid4().hex}"
HELD_STEP = 3  # of the 8 of RUN_SETS: the stopped run waits there for `fab stop`


def _latest_step(run) -> int:
    markers = list((run.code / "checkpoints").glob("run-*/latest"))
    return int(markers[0].read_text().strip().split("-")[1]) if markers else 0


@pytest.fixture(scope="module")
def killed_run(project, sshd, tmp_path_factory, smoke_run):
    """A run whose training process is SIGKILLed once, after its first checkpoint."""
    base = tmp_path_factory.mktemp("killed-run")
    fab = make_fab(project, base / "home", base / "remote", sshd)
    run = launch_run(
        fab, sshd, base / "remote", *set_args(RUN_SETS), env={"CLIPFORGE_ALERT_WEBHOOKS": SECRET}
    )
    run.wait_until(
        lambda: _latest_step(run) >= 2 and train_stage_process(run.code), what="first checkpoint"
    )
    pid = train_stage_process(run.code)
    run.environment_seen = environment_of(pid)
    run.killed_after_step = _latest_step(run)
    os.kill(pid, signal.SIGKILL)
    run.final_state = run.wait_finished()
    return run


def test_killed_training_process_is_restarted(killed_run):
    """SIGKILL of the training process: the supervisor records the abnormal exit, restarts once,
    and the run finishes."""
    state = killed_run.final_state
    assert state["state"] == "finished"
    assert state["restarts"] == 1
    assert [e["phase"] for e in state["exits"]] == ["train"] and state["exits"][0]["code"] != 0


def test_restarted_run_ends_like_an_uninterrupted_one(killed_run, smoke_run):
    """After the restart the stage resumed from its checkpoint and ended with the same final
    metrics and the same exported weights as the uninterrupted training."""
    info = json.loads((killed_run.code / "metrics" / "train.info.json").read_text())
    reference_info = json.loads((smoke_run.node_dir / "smoke.json").read_text())["trained"]
    assert info["resumed_from_step"] >= killed_run.killed_after_step > 0
    assert (info["run_id"], info["steps"]) == (reference_info["run_id"], reference_info["steps"])
    summary = json.loads((killed_run.code / "metrics" / "train.json").read_text())
    assert summary == json.loads((smoke_run.code / "metrics" / "train.json").read_text())
    assert exported_weights(killed_run.code / "models" / "clip") == exported_weights(
        smoke_run.code / "models" / "clip"
    )


def test_the_restarted_runs_curves_hold_every_step_once(killed_run):
    """The restart went through `dvc exp run` again: the curve before the checkpoint it resumed
    from is still there (DVC does not delete the persistent TSVs), and the steps after it, logged
    before the kill and again after the restart, are there once, in TensorBoard too."""
    assert tsv_steps(killed_run.code) == list(range(1, 9))
    assert event_steps(killed_run.code) == list(range(1, 9))


def test_restart_is_logged_and_counted_in_status(killed_run):
    """The restart shows in `fab logs` (a supervisor line) and in `fab status` (restarts 1/5)."""
    logs = killed_run.run_fab("logs", "--lines", "1000")
    assert "restart 1/5" in logs.stdout and "signal SIGKILL" not in logs.stdout  # dvc's exit code
    status = killed_run.run_fab("status")
    assert status.returncode == 0 and "1/5" in status.stdout and "finished" in status.stdout


def test_alert_webhooks_reach_the_run_but_no_file(killed_run):
    """CLIPFORGE_ALERT_WEBHOOKS set for `fab train` is in the training process's environment, and
    in no file on the host (run record, plan, state, logs)."""
    assert killed_run.environment_seen.get("CLIPFORGE_ALERT_WEBHOOKS") == SECRET
    assert files_containing(killed_run.root, SECRET) == []
    record = json.loads((killed_run.root / "runs" / killed_run.launch_id / "run.json").read_text())
    assert record["env_passed_through"] == ["CLIPFORGE_ALERT_WEBHOOKS"]


STALE_RUN = "run-000000000000"


@pytest.fixture(scope="module")
def project_with_results(project, tmp_path_factory):
    """The project as a user's repository that commits its results, as DVC asks: metrics/ of an
    earlier 93-step run (final loss 1.8089), stale for any new run shipped from it."""
    clone = tmp_path_factory.mktemp("with-results") / "project"
    git(clone.parent, "clone", "--quiet", str(project), str(clone))
    metrics = clone / "metrics"
    metrics.mkdir()
    rows = ["\t".join(COLUMNS)] + [
        "\t".join(
            f"{step}" if c == "step" else STALE_RUN if c == "run_id" else "1.8089" for c in COLUMNS
        )
        for step in (90, 93)
    ]
    (metrics / "train.tsv").write_text("\n".join(rows) + "\n")
    (metrics / "train.json").write_text(json.dumps({"loss": 1.8089, "val_loss": 1.8382}))
    (metrics / "train.info.json").write_text(json.dumps({"run_id": STALE_RUN, "steps": 93}))
    git(clone, "add", "metrics")
    git(clone, "commit", "--quiet", "-m", "results of an earlier run")
    return clone


@pytest.fixture(scope="module")
def stopped_run(project_with_results, sshd, tmp_path_factory):
    """A run stopped with `fab stop` once it has trained a step, shipped from a checkout holding
    an earlier run's metrics. Its step 3 is held until the stop arrives (CLIPFORGE_FAULTS=hold@3),
    so the run cannot end first however fast this machine is; `fab status` looks at it while
    held; `fab train --resume` later runs without the hold."""
    base = tmp_path_factory.mktemp("stopped-run")
    fab = make_fab(project_with_results, base / "home", base / "remote", sshd)
    run = launch_run(
        fab,
        sshd,
        base / "remote",
        *set_args(RUN_SETS),
        env={"CLIPFORGE_FAULTS": f"hold@{HELD_STEP}"},
    )
    # metrics/train.tsv is committed (an earlier run's): wait for this run's own first row
    tsv = run.code / "metrics" / "train.tsv"
    run.wait_until(
        lambda: (
            tsv.is_file()
            and any(
                row.split("\t")[-1] not in (STALE_RUN, "run_id")
                for row in tsv.read_text().splitlines()
            )
        ),
        what="first metrics row",
    )
    run.status_while_held = run.run_fab("status")
    run.clean_while_running = run.run_fab("clean")
    run.interrupted = {
        command: _interrupted_once_shown(run, sshd, command, "--" + flag)
        for command, flag in (("logs", "follow"), ("status", "watch"))
    }
    run.state_after_interrupt = run.state()
    follower = run.fab.popen("logs", "--follow", hosts=sshd.address, key=sshd.client_key)
    run.stop_result = run.run_fab("stop")
    run.followed = follower.communicate(timeout=120)[0]
    run.follower_code = follower.returncode
    run.state_after_stop = run.state()
    run.processes_after_stop = processes_under(run.root)
    return run


def _interrupted_once_shown(run, sshd, *args: str) -> tuple[str, str, int]:
    """Ctrl-C on `fab ARGS` once it has shown its first line: that line, the rest, the exit."""
    process = run.fab.popen(*args, hosts=sshd.address, key=sshd.client_key)
    assert process.stdout is not None
    first = process.stdout.readline()
    process.send_signal(signal.SIGINT)
    rest = process.communicate(timeout=60)[0]
    return first, rest, process.returncode


def test_status_shows_this_run_not_the_checkouts_old_results(stopped_run):
    """The checkout holds an earlier run's metrics (93 steps, final loss 1.8089); while this run
    is held at step 3, `fab status` shows this run's own step of its 8 and its own loss: no final
    loss, and an ETA that is not zero."""
    result = stopped_run.status_while_held
    assert result.returncode == 0, result.stderr
    rows = dict(re.findall(r"^  (\w[\w/]*)\s+(.+)$", result.stdout, re.MULTILINE))
    done, total = map(int, rows["step"].split()[0].split("/"))
    assert total == 8 and 1 <= done < HELD_STEP, result.stdout
    assert "1.8089" not in rows["loss"] and "(final)" not in rows["loss"]
    assert rows["state"].startswith("running") and rows["ETA"] not in ("0m00s", "-")


def test_launch_returns_while_the_run_goes_on(stopped_run):
    """`fab train` returns (its SSH session closed) while the run is still going; the run, detached
    from that session, carries on until it is stopped."""
    assert stopped_run.state_at_return["state"] in ("starting", "running")
    assert stopped_run.state_after_stop["state"] == "stopped" and _latest_step(stopped_run) > 0


def test_stop_checkpoints_then_ends_the_run(stopped_run):
    """`fab stop`: the stage saves a checkpoint at the next step boundary and exits; the supervisor
    restarts nothing and nothing of the run is left running."""
    result = stopped_run.stop_result
    assert result.returncode == 0, result.stdout + result.stderr
    assert stopped_run.state_after_stop["state"] == "stopped"
    assert stopped_run.state_after_stop["restarts"] == 0
    step = _latest_step(stopped_run)
    assert 0 < step <= HELD_STEP
    assert f"step-{step:08d}" in result.stdout
    assert stopped_run.processes_after_stop == []


def test_resume_after_stop_trains_on_to_the_same_result(stopped_run, smoke_run):
    """`fab train --resume ID` starts the supervisor again: the stage resumes from the stop's
    checkpoint and ends where the uninterrupted training ended."""
    stopped_at = _latest_step(stopped_run)
    result = stopped_run.run_fab("train", "--resume", stopped_run.launch_id)
    assert result.returncode == 0, result.stdout + result.stderr
    assert stopped_run.wait_finished()["state"] == "finished"
    summary = json.loads((stopped_run.code / "metrics" / "train.json").read_text())
    reference = json.loads((smoke_run.code / "metrics" / "train.json").read_text())
    info = json.loads((stopped_run.code / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == stopped_at
    assert summary["loss"] == reference["loss"] and summary["val_loss"] == reference["val_loss"]
    # the steps before the stop kept, this run's only (not the checkout's earlier run's)
    assert tsv_steps(stopped_run.code) == list(range(1, 9))
    assert event_steps(stopped_run.code) == list(range(1, 9))


def test_logs_follow_streams_until_the_run_ends(stopped_run):
    """`fab logs --follow` started during the run returns by itself once the run has ended (here:
    stopped), having shown the stage's output up to the end."""
    assert stopped_run.follower_code == 0
    assert (
        "clipforge.train" in stopped_run.followed and "stopped on request" in stopped_run.followed
    )


def test_ctrl_c_ends_logs_follow_and_status_watch_at_once_and_the_run_goes_on(stopped_run):
    """Ctrl-C on `fab logs --follow` and on `fab status --watch` during a run ends each as an
    interrupt (exit 130, no traceback; the follower exited 1, an error, before); the run is not
    touched."""
    for command, (first, rest, code) in stopped_run.interrupted.items():
        assert first.strip() and code == 130, (command, first, rest)
        assert "Traceback" not in rest, command
    assert stopped_run.state_after_interrupt["state"] == "running"


def test_clean_refuses_a_running_run(stopped_run):
    """`fab clean` while the run trains: refused, pointing at `fab stop`; the run untouched."""
    result = stopped_run.clean_while_running
    assert result.returncode != 0 and "fab stop" in result.stderr
    assert stopped_run.state_after_stop["restarts"] == 0  # the run went on until the stop


def test_clean_removes_an_ended_run(stopped_run):
    """`fab clean` after the run ended removes it from the host, and the `current` marker."""
    result = stopped_run.run_fab("clean")
    assert result.returncode == 0, result.stderr
    assert not (stopped_run.root / "runs" / stopped_run.launch_id).exists()
    assert not (stopped_run.root / "current").exists()
