"""Faults that repeat the same way on every restart end the run at once: no restart spent, the
stage's own line as `fab status`'s state, and the run's real last step (clipforge.fault_record).
The supervisor runs real stages here, or a snippet that ends as a stage ends (seconds each)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from clipforge.errors import DiskFull, StageError
from clipforge.fault_record import FAULT_RECORD_ENV, read_fault, record_fault
from clipforge.launcher.host.plan import Phase
from clipforge.launcher.host.state import parse_state
from clipforge.launcher.host.status import summarize
from tests.conftest import write_params
from tests.launcher.host.test_supervisor import _log, _node, _sh, _state, _supervise

DISK_FULL_LINE = (
    "disk full at /runs/checkpoints/run-x: 67,215,360 bytes free, a checkpoint needs "
    "~87,404,130 bytes; free space there (or give --checkpoints another disk) and rerun the "
    "stage to resume from the last checkpoint"
)
# Ends as the train stage ends on a full disk at the save of step 10: its line, the record, 2.
_DISK_FULL_STAGE = f"""
import sys
from clipforge.errors import DiskFull
from clipforge.fault_record import record_fault
print("clipforge.train: error: {DISK_FULL_LINE}", file=sys.stderr)
record_fault(DiskFull({DISK_FULL_LINE!r}, step=10))
sys.exit(2)
"""


def _python(name: str, code: str, cwd: Path) -> Phase:
    return Phase(name=name, argv=[sys.executable, "-c", code], cwd=str(cwd))


def test_a_refused_input_of_the_real_train_stage_ends_the_run_at_once(tmp_path):
    """The train stage refuses its input (no data manifest): one attempt, no restart, and the
    state's reason is the stage's own line; the eval phase after it never runs."""
    params = write_params(tmp_path / "params.yaml")
    train = Phase(
        name="train",
        argv=[
            sys.executable,
            "-m",
            "clipforge.train",
            "--params",
            str(params),
            "--data",
            str(tmp_path / "no-data"),
        ],
        cwd=str(tmp_path),
    )
    process = _supervise(tmp_path, train, _sh("eval", "touch evaluated", tmp_path), max_restarts=3)
    state = _state(tmp_path)
    assert process.returncode == 1 and state["state"] == "failed"
    assert state["restarts"] == 0 and [(e["code"], e["fault"]) for e in state["exits"]] == [
        (2, "input")
    ]
    assert state["reason"] == (
        f"{tmp_path / 'no-data' / 'manifest.json'} not found: run the data stage first (`dvc "
        f"repro data` or `python -m clipforge.data`) (not restarted: it would fail the same way)"
    )
    assert not (tmp_path / "evaluated").exists()
    assert "restart 1/3" not in _log(tmp_path)


def test_a_full_disk_gives_its_cause_and_the_step_reached_as_fab_status_says_them(tmp_path):
    """A stage ending on a full disk at step 10, its metrics gone (DVC removes a stage's outputs
    before it runs it): `fab status` says the cause as the state and step 10/20, not 0/20."""
    process = _supervise(tmp_path, _python("train", _DISK_FULL_STAGE, tmp_path), max_restarts=2)
    state = _state(tmp_path)
    assert process.returncode == 1 and state["restarts"] == 0 and state["last_step"] == 10
    info = {
        "record": {},
        "state": state,
        "last_row": None,
        "total_steps": 20,
        "latest_checkpoint": "/runs/checkpoints/run-x/step-00000005",
        "host_time": state["finished_at"],
    }
    rows = dict(summarize(info, None))
    assert rows["state"] == f"failed: {DISK_FULL_LINE} (not restarted: it would fail the same way)"
    assert rows["step"] == "10/20" and rows["restarts"] == "0/2"


def test_a_fault_a_restart_may_clear_is_restarted_as_before(tmp_path):
    """A crash that records nothing, and a record left by an earlier attempt, are no reason to
    give up: the record is cleared before each attempt, and the third attempt succeeds."""
    node = _node(tmp_path)
    Path(node.node_dir).mkdir(parents=True)
    record_fault(DiskFull("stale"), {FAULT_RECORD_ENV: node.fault_record})
    script = 'n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count; [ "$n" -ge 2 ]'
    process = _supervise(tmp_path, _sh("train", script, tmp_path))
    state = _state(tmp_path)
    assert process.returncode == 0 and state["state"] == "finished" and state["restarts"] == 2
    assert all("fault" not in e for e in state["exits"])


def test_the_stage_records_its_fault_only_under_a_supervisor_and_only_a_repeating_one(
    tmp_path, monkeypatch
):
    from clipforge.checkpoints.lock import RunBusy

    path = tmp_path / "fault.json"
    record_fault(StageError("no supervisor asked"), {})
    assert not path.exists()
    record_fault(RunBusy("held by pid 1"), {FAULT_RECORD_ENV: str(path)})
    assert not path.exists()
    record_fault(StageError("two\nlines"), {FAULT_RECORD_ENV: str(path)})
    fault = read_fault(path)
    assert fault is not None and (fault.kind, fault.cause, fault.step) == (
        "input",
        "two lines",
        None,
    )
    path.write_text(json.dumps({"kind": "bogus", "cause": "x"}))
    assert read_fault(path) is None


@pytest.mark.parametrize("step", [None, 7])
def test_status_takes_the_furthest_of_the_rows_the_record_and_the_checkpoint(step):
    state = parse_state(
        json.dumps({"state": "failed", "started_at": 1.0, "max_restarts": 2, "last_step": step})
    )
    from clipforge.launcher.host.status import last_step

    assert last_step({"step": "4"}, state, "/c/run-x/step-00000006") == (step or 6)
    assert last_step({}, None, None) == 0
