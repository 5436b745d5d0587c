"""The run record (run.json) as a typed record: one reader that round-trips what `fab train`
writes, takes a record without its optional fields, and says what is wrong with a damaged file."""

from __future__ import annotations

import json

import pytest

from clipforge.launcher.host.record import (
    RunRecordError,
    SocketInterface,
    parse_record,
    read_record,
    record_from_dict,
)
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.status import collect, summarize
from tests.support.records import run_record


def test_a_record_round_trips_through_its_json():
    record = run_record(
        num_nodes=2,
        hosts=("a", "b"),
        master="10.0.0.1:29500",
        socket_interfaces=(SocketInterface("eth1", "10.0.0.1", "route to a"),),
        overrides=("train.max_steps=8",),
    )
    assert parse_record(record.to_json()) == record
    raw = json.loads(record.to_json())
    assert raw["hosts"] == ["a", "b"] and raw["socket_interfaces"][0]["interface"] == "eth1"


def test_the_store_copy_with_its_extra_keys_is_a_record():
    """The train stage copies run.json to the store adding training_run and store: a reader
    ignores keys it does not know (a newer launcher's too)."""
    raw = {**run_record().to_dict(), "training_run": "run-0123456789ab", "store": "s3://b/runs"}
    assert record_from_dict(raw) == run_record()


def test_the_optional_fields_may_be_left_out_and_the_launch_is_named_launch_id_only():
    """container_user, socket_interfaces, min_gpus: absent, their defaults. A launch id under
    `run_id` (the training run's name) is no launch id: the record lacks one."""
    raw = run_record().to_dict()
    del raw["container_user"], raw["socket_interfaces"], raw["min_gpus"]
    assert record_from_dict(raw).container_user is None
    raw["run_id"] = raw.pop("launch_id")
    with pytest.raises(RunRecordError, match="not a run record, missing launch_id"):
        record_from_dict(raw)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: "[1, 2]", "not a JSON object but list"),
        (lambda r: '{"launch_id": "x"', "not JSON"),
        (lambda r: json.dumps({"launch_id": "x"}), "not a run record, missing commit"),
        (lambda r: json.dumps({**r, "gpus_per_node": "4"}), "gpus_per_node is '4'"),
        (lambda r: json.dumps({**r, "num_nodes": True}), "num_nodes is True"),
        (lambda r: json.dumps({**r, "hosts": ["a", 2]}), "hosts is .* not a list of strings"),
        (lambda r: json.dumps({**r, "socket_interfaces": [{"interface": "eth0"}]}), "socket_"),
    ],
)
def test_a_damaged_record_says_what_is_wrong(tmp_path, change, message):
    path = tmp_path / "run.json"
    path.write_text(change(run_record().to_dict()))
    with pytest.raises(RunRecordError, match=message) as error:
        read_record(path)
    assert str(path) in str(error.value)


def test_no_record_is_none(tmp_path):
    assert read_record(tmp_path / "run.json") is None


def test_status_shows_a_damaged_record_and_goes_on(tmp_path):
    """`fab status` on a node whose run.json is damaged says so in its launch row; the other
    rows are still read."""
    node = NodeLayout(root=str(tmp_path), launch_id="run", node_rank=0)
    (tmp_path / "runs" / "run" / "node-0").mkdir(parents=True)
    (tmp_path / "runs" / "run" / "run.json").write_text('{"launch_id": "run"}')
    info = collect(node)
    rows = dict(summarize(json.loads(json.dumps(info)), None))
    assert rows["launch"].startswith("unknown: ") and "missing commit" in rows["launch"]
    assert rows["state"]


def test_status_reads_the_record(tmp_path):
    node = NodeLayout(root=str(tmp_path), launch_id="run", node_rank=0)
    (tmp_path / "runs" / "run" / "node-0").mkdir(parents=True)
    (tmp_path / "runs" / "run" / "run.json").write_text(run_record(launch_id="run").to_json())
    rows = dict(summarize(collect(node), None))
    assert rows["launch"] == "run (commit 0123456789, host runtime, 1 node x CPU)"
