"""The supervisor's state as a typed record: one reader that round-trips what the supervisor
writes and says what is wrong with a damaged file; status shows a damaged or lost state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.state import (
    TERMINAL_STATES,
    RunState,
    StateFileError,
    SupervisorState,
    parse_state,
    read_state,
)
from clipforge.launcher.host.status import collect, summarize


def test_a_state_round_trips_through_its_json():
    state = SupervisorState(
        state=RunState.BACKOFF,
        supervisor_pid=12,
        started_at=1.5,
        max_restarts=3,
        restarts=1,
        exits=[{"phase": "train", "attempt": 1, "code": -9, "at": 2.0, "hang": "no step"}],
    )
    assert parse_state(state.to_json()) == state
    assert json.loads(state.to_json())["state"] == "backoff"


def test_terminal_and_started_states():
    assert set(TERMINAL_STATES) == {RunState.FINISHED, RunState.STOPPED, RunState.FAILED}
    assert "failed" in TERMINAL_STATES  # a str enum: old readers comparing strings still work
    assert RunState.BACKOFF.started and not RunState.FAILED.started


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"state": "running", "started_at": 1', "not JSON"),
        ("[1, 2]", "not a JSON object but list"),
        ('{"state": "running"}', "missing started_at, max_restarts"),
        ('{"state": "sleeping", "started_at": 1, "max_restarts": 3}', "state is 'sleeping'"),
        ('{"state": "running", "started_at": 1, "max_restarts": "3"}', "max_restarts is '3'"),
    ],
)
def test_a_damaged_state_says_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "state.json"
    path.write_text(text)
    with pytest.raises(StateFileError, match=message) as error:
        read_state(path)
    assert str(path) in str(error.value)


def test_no_state_yet_is_none(tmp_path):
    assert read_state(tmp_path / "state.json") is None


def _node(tmp_path: Path, state_text: str) -> NodeLayout:
    layout = NodeLayout(root=str(tmp_path), launch_id="run", node_rank=0)
    Path(layout.node_dir).mkdir(parents=True)
    Path(layout.state).write_text(state_text)
    return layout


def test_status_shows_a_damaged_state_and_a_lost_supervisor(tmp_path):
    """A garbled state.json is shown as damaged with the reason; a running state without a
    live supervisor is lost."""
    damaged = collect(_node(tmp_path / "a", "{torn"))
    assert dict(summarize(damaged, None))["state"].startswith("damaged: ")
    running = SupervisorState(
        state=RunState.RUNNING, supervisor_pid=2**22 + 1, started_at=1.0, max_restarts=3
    )
    lost = collect(_node(tmp_path / "b", running.to_json()))
    assert lost["state"]["state"] == "lost"
    assert dict(summarize(lost, None))["state"].startswith("lost: ")


def test_status_shows_goodput_and_what_the_lost_time_cost():
    """250 steps x 2 s = 500 s of training in 1000 s since the supervisor started (a crash and
    its redone steps, set-up, saves): 50% goodput, the other half's GPU cost priced."""
    from decimal import Decimal

    from clipforge.launcher.host.status import goodput

    assert goodput(250, 2.0, 1000.0) == 0.5
    assert goodput(900, 2.0, 1000.0) == 1.0  # steps brought by an earlier launch
    assert goodput(10, None, 1000.0) is None
    info = {
        "record": {"run_id": "r", "commit": "c", "runtime": "host", "gpus_per_node": 4},
        "state": {"state": "running", "started_at": 100.0, "max_restarts": 3, "restarts": 1},
        "last_row": {"step": "250"},
        "recent_step_seconds": [2.0],
        "host_time": 1100.0,
    }
    row = dict(summarize(info, Decimal("3.60")))["goodput"]
    # 500 s lost x 4 GPUs x 3.60/h = 2.00
    assert row.startswith("50% of the time trained; 8m20s went elsewhere (2.00 of the cost)")
