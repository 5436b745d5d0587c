"""A hang in set-up is a hang: a real run through `fab` whose trainer is stopped (SIGSTOP) before
its first step is dumped, alerted and restarted on alerts.setup_timeout_seconds, and ends
finished with eval run and every step logged once."""

from __future__ import annotations

import os
import signal

import pytest

from clipforge.progress import read_progress
from tests.launcher.conftest import RUN_SETS, launch_run, set_args
from tests.support.run_curves import event_steps, tsv_steps

# A real run through `fab` with a restart: in make test-tier2. make test keeps the claim on a
# stand-in rank (test_supervisor.py: a rank hung in set-up is a hang on its own budget).
pytestmark = [pytest.mark.slow, pytest.mark.tier2]
# Long enough for each part of set-up on a loaded 2-core machine (importing the stack: seconds).
SETUP_SECONDS = 60


def test_a_trainer_stopped_in_set_up_is_restarted_and_the_run_finishes(fab, sshd, remote_root):
    run = launch_run(
        fab,
        sshd,
        remote_root,
        *set_args([*RUN_SETS, f"alerts.setup_timeout_seconds={SETUP_SECONDS}"]),
    )
    progress = run.node_dir / "progress"

    def in_set_up():
        beats = [p for p in read_progress(progress) if p.rank == 0 and p.doing]
        return beats[0] if beats and beats[0].step is None else None

    run.wait_until(in_set_up, what="the trainer's first set-up beat")
    os.kill(in_set_up().pid, signal.SIGSTOP)
    stopped_in = in_set_up()  # stopped before it left set-up (its imports take seconds)
    assert stopped_in is not None
    final = run.wait_finished(timeout=900)
    log = (run.node_dir / "train.log").read_text()
    supervisor = [line for line in log.splitlines() if "clipforge supervisor" in line]
    assert final["state"] == "finished" and final["restarts"] == 1, (final, stopped_in, supervisor)
    hang = final["exits"][0]["hang"]
    assert "no progress while" in hang and f"setup_timeout_seconds={SETUP_SECONDS}" in hang
    assert "stacks of rank 0" in log
    assert (run.code / "metrics" / "eval.json").is_file()
    assert tsv_steps(run.code) == list(range(1, 9))
    assert event_steps(run.code) == list(range(1, 9))
    status = run.run_fab("status")
    assert "finished" in status.stdout and "1/5" in status.stdout, status.stdout
