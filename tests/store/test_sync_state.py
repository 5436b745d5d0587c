"""The run store's sync state (sync.json, the store's status.json) as a typed record: one reader
that round-trips what the uploader writes and says what is wrong with a damaged file; status
shows a damaged one instead of failing."""

from __future__ import annotations

import json

import pytest

from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.status import collect, summarize, sync_text
from clipforge.store.sync_state import (
    SyncPhase,
    SyncState,
    SyncStateError,
    parse_sync_state,
    read_sync_state,
)

STATE = SyncState(
    run_id="run-0123456789ab",
    launch_id="20261201-120000-0123456789",
    state=SyncPhase.TRAINING,
    host="box",
    updated_at=1.5,
    store="s3://bucket/runs/run-0123456789ab",
    store_step=4,
    lag_steps=2,
    lag_seconds=30.0,
    failures=1,
    last_error="ConnectionError: no answer",
)


def test_a_sync_state_round_trips_through_its_json():
    assert parse_sync_state(STATE.to_json()) == STATE
    assert json.loads(STATE.to_json())["state"] == "training"
    assert sync_text(STATE) == (
        "s3://bucket/runs/run-0123456789ab: step 4, behind by 2 steps / 0m30s, "
        "1 failed attempts (ConnectionError: no answer)"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: "[]", "not a JSON object but list"),
        (lambda r: '{"run_id": ', "not JSON"),
        (lambda r: json.dumps({"run_id": "x", "state": "training"}), "missing launch_id, host"),
        (lambda r: json.dumps({**r, "state": "uploading"}), "state is 'uploading'"),
        (lambda r: json.dumps({**r, "lag_steps": "2"}), "lag_steps is '2'"),
        (lambda r: json.dumps({**r, "failures": False}), "failures is False"),
    ],
)
def test_a_damaged_sync_state_says_what_is_wrong(tmp_path, change, message):
    path = tmp_path / "sync.json"
    path.write_text(change(STATE.to_dict()))
    with pytest.raises(SyncStateError, match=message) as error:
        read_sync_state(path)
    assert str(path) in str(error.value)


def test_status_shows_the_sync_state_or_what_is_wrong_with_it(tmp_path):
    node = NodeLayout(root=str(tmp_path), launch_id="run", node_rank=0)
    run_dir = tmp_path / "runs" / "run" / "node-0" / "code" / "checkpoints" / "run-0123456789ab"
    run_dir.mkdir(parents=True)
    (run_dir / "sync.json").write_text(STATE.to_json())
    rows = dict(summarize(json.loads(json.dumps(collect(node))), None))
    assert rows["run store"] == sync_text(STATE)
    (run_dir / "sync.json").write_text('{"run_id": "run-0123456789ab"}')
    rows = dict(summarize(collect(node), None))
    assert (
        rows["run store"].startswith("unknown: ")
        and "missing state, launch_id" in rows["run store"]
    )
