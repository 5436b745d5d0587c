"""`fab rerun`: what a rerun launches (clipforge.launcher.rerun), and what its train stage refuses
before it trains (clipforge.repeats): moved data, named by its first differing shard, and a
different stack unless the rerun allows one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess

import pytest
import yaml

from clipforge import envrecord
from clipforge.fault_record import FAULT_RECORD_ENV, read_fault
from clipforge.launcher.host.record import record_from_dict
from clipforge.launcher.rerun import find_original, plan
from clipforge.repeats import (
    Repeats,
    StackChanged,
    check_stack,
    manifest_difference,
    of_record,
)
from clipforge.store.remote import RUN_RECORD_ENV
from tests.conftest import REPO, run_train
from tests.support.repro_runs import fab, make_run

LAUNCH = "20260101-000000-0123abcd"


def _manifest(*shards: tuple[str, str]) -> dict:
    return {
        "source": {"kind": "local", "path": "/data/pairs"},
        "splits": {
            "train": {
                "count": 2 * len(shards),
                "shards": [{"name": n, "count": 2, "sha256": d} for n, d in shards],
            }
        },
    }


def _repeats(manifest_bytes: bytes) -> Repeats:
    """A rerun of run LAUNCH, which trained on the manifest `manifest_bytes` with this stack."""
    return Repeats(
        launch_id=LAUNCH,
        run=f"runs/{LAUNCH}",
        training_run="run-000000000000",
        data_manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
        data_manifest=json.loads(manifest_bytes),
        stack=dataclasses.asdict(envrecord.stack()),
    )


def test_the_first_differing_shard_is_named_before_any_other_difference():
    before = _manifest(("train/shard-000000.tar", "a" * 64), ("train/shard-000001.tar", "b" * 64))
    after = _manifest(("train/shard-000000.tar", "a" * 64), ("train/shard-000001.tar", "c" * 64))
    after["source"]["path"] = "/data/other"
    assert manifest_difference(before, after) == (
        "train shard train/shard-000001.tar: sha256 bbbbbbbbbbbb -> cccccccccccc"
    )
    after["splits"]["train"]["shards"].pop()
    assert manifest_difference(before, after) == "train shard train/shard-000001.tar is gone"
    assert manifest_difference(before, before) is None


def test_a_stack_difference_is_refused_unless_allowed_and_named_either_way():
    current = dataclasses.asdict(envrecord.stack())
    recorded = {**current, "torch": "2.1.2", "deepspeed": "0.14.5"}
    refused = dataclasses.replace(_repeats(b"{}"), stack=recorded)
    with pytest.raises(StackChanged) as caught:
        check_stack(refused, current)
    line = str(caught.value)
    assert f"torch 2.1.2 -> {current['torch']}" in line and "results may differ" in line
    assert "--allow-stack-change" in line and "\n" not in line
    assert caught.value.fault == "stack"
    allowed = dataclasses.replace(refused, allow_stack_change=True)
    assert check_stack(allowed, current) == [
        f"torch 2.1.2 -> {current['torch']}",
        f"deepspeed 0.14.5 -> {current['deepspeed']}",
    ]


def test_the_train_stage_refuses_a_rerun_whose_data_moved_naming_the_changed_shard(
    tmp_path, small_data, monkeypatch, capsys
):
    """A shard of the manifest changed since the run (the data rebuilt from a changed source):
    the stage ends in one line naming it, as an `input` fault, and trains nothing."""
    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    original = (data / "manifest.json").read_bytes()
    manifest = json.loads(original)
    shard = manifest["splits"]["train"]["shards"][-1]
    (data / shard["name"]).write_bytes(b"rebuilt")
    shard["sha256"] = hashlib.sha256(b"rebuilt").hexdigest()
    (data / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    record = tmp_path / "run.json"
    record.write_text(json.dumps({"launch_id": LAUNCH, "repeats": _repeats(original).to_dict()}))
    monkeypatch.setenv(RUN_RECORD_ENV, str(record))
    monkeypatch.setenv(FAULT_RECORD_ENV, str(tmp_path / "fault.json"))

    (tmp_path / "out").mkdir()
    assert run_train(tmp_path / "out", data) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert f"the data moved since run runs/{LAUNCH}" in errors[0]
    assert f"first difference: train shard {shard['name']}: sha256" in errors[0]
    fault = read_fault(tmp_path / "fault.json")
    assert fault is not None and fault.kind == "input"
    assert not (tmp_path / "out" / "checkpoints").exists()


def _launched_run(tmp_path):
    """A finished run as `fab fetch` brings it home: results, node 0's run.json and params."""
    run = make_run(tmp_path / "runs" / LAUNCH, manifest="f" * 64)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    params = {"train": {"lr": 0.001, "seed": 0}, "storage": {"remote": None}}
    record = {
        "launch_id": LAUNCH,
        "commit": commit,
        "dirty_paths_not_shipped": [],
        "created_at": "2026-01-01T00:00:00Z",
        "launched_by": "me@laptop",
        "hosts": ["me@gpu:22"],
        "host": "me@gpu:22",
        "num_nodes": 1,
        "gpus_per_node": 0,
        "runtime": "host",
        "image": "clipforge:abc",
        "data": "build",
        "smoke": True,
        "executor": "dvc exp run",
        "overrides": ["train.num_nodes=1", "train.device=cpu", "train.max_steps=4"],
        "params": params,
        "checkpoints_dir": "/runs/x/checkpoints",
        "master": None,
        "max_restarts": 3,
        "env_passed_through": [],
    }
    (run / "node-0").mkdir()
    (run / "node-0" / "run.json").write_text(json.dumps(record))
    (run / "node-0" / "params.resolved.yaml").write_text(yaml.safe_dump(params))
    return run, commit


def test_a_rerun_ships_the_recorded_commit_options_and_params_and_says_what_it_repeats(tmp_path):
    run, commit = _launched_run(tmp_path)
    original = find_original(LAUNCH, store=None, runs=tmp_path / "runs")
    prepared, options = plan(original, allow_stack_change=False, start=REPO)
    assert prepared.source.commit == commit and prepared.image == "clipforge:abc"
    assert prepared.params_yaml == (run / "node-0" / "params.resolved.yaml").read_text()
    assert options.overrides == ("train.num_nodes=1", "train.device=cpu", "train.max_steps=4")
    assert (options.gpus, options.runtime, options.data, options.smoke) == (
        0,
        "host",
        "build",
        True,
    )
    repeats = of_record({"repeats": prepared.repeats})
    assert repeats is not None and repeats.launch_id == LAUNCH and repeats.run == LAUNCH
    assert repeats.data_manifest_sha256 == "f" * 64 and repeats.stack is not None
    # the new launch's run.json carries it, through the one reader
    from clipforge.launcher.launch import run_record

    new = run_record(
        "20260102-000000-0123abcd",
        prepared,
        options,
        ["me@gpu:22"],
        checkpoints_dir="/c",
        master=None,
        interfaces=None,
        user=None,
    )
    assert record_from_dict(json.loads(new.to_json())).repeats == prepared.repeats


def test_fab_rerun_refuses_a_run_fab_train_did_not_start_in_one_line(tmp_path):
    run = make_run(tmp_path / "local-run")
    result = fab("rerun", str(run))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "no launch record" in result.stderr and "`fab rerun` repeats runs" in result.stderr


def test_the_train_stage_refuses_a_rerun_on_another_stack_before_it_trains(
    tmp_path, small_data, monkeypatch, capsys
):
    """The data is the run's, the stack is not (torch 0.0.1 recorded): one line naming it, a
    `stack` fault, nothing trained."""
    original = (small_data / "manifest.json").read_bytes()
    repeats = _repeats(original)
    assert repeats.stack is not None
    repeats = dataclasses.replace(repeats, stack={**repeats.stack, "torch": "0.0.1"})
    record = tmp_path / "run.json"
    record.write_text(json.dumps({"launch_id": LAUNCH, "repeats": repeats.to_dict()}))
    monkeypatch.setenv(RUN_RECORD_ENV, str(record))
    monkeypatch.setenv(FAULT_RECORD_ENV, str(tmp_path / "fault.json"))

    (tmp_path / "out").mkdir()
    assert run_train(tmp_path / "out", small_data) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "torch 0.0.1 -> " in errors[0], errors
    assert "--allow-stack-change" in errors[0]
    fault = read_fault(tmp_path / "fault.json")
    assert fault is not None and fault.kind == "stack"
    assert not (tmp_path / "out" / "checkpoints").exists()
