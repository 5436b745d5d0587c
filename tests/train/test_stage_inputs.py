"""What the train stage refuses before it imports the training stack: every check that needs no
model (the batch against the data, the data stage's output, initial weights, writable output
folders) runs first, so a wrong input costs a fraction of a second, not a model build."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from tests.conftest import REPO, run_train, subprocess_env, write_params
from tests.support.mounts import remount, tmpfs

# Runs the stage in a fresh interpreter and reports whether torch was ever imported.
STAGE_THEN_MODULES = """
import sys
from clipforge.train.stage import main
code = main(sys.argv[1:])
print(code, "torch" in sys.modules)
"""


def test_a_global_batch_larger_than_the_data_is_refused_before_torch_is_imported(
    tmp_path, small_data
):
    """Refused by the stage shell from the manifest's counts, not after seconds of building the
    model."""
    params = write_params(tmp_path / "params.yaml")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            STAGE_THEN_MODULES,
            "--params",
            str(params),
            "--data",
            str(small_data),
            "--checkpoints",
            str(tmp_path / "checkpoints"),
            "--set",
            "train.global_batch_size=65536",
            "--set",
            "train.micro_batch_size=128",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=REPO,
        timeout=120,
    )
    assert result.stdout == "2 False\n"
    assert result.stderr == (
        "clipforge.train: error: train.global_batch_size: 65536 is larger than the 192 training "
        "samples in data/; lower it or add data\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def _data_copy(tmp_path, small_data):
    return shutil.copytree(small_data, tmp_path / "data")


def test_a_manifest_that_is_not_one_is_named(tmp_path, small_data, capsys):
    data = _data_copy(tmp_path, small_data)
    (data / "manifest.json").write_text('{"splits": {"train": {}}}')
    assert run_train(tmp_path, data) == 2
    assert capsys.readouterr().err == (
        f"clipforge.train: error: {data / 'manifest.json'}: not a data stage manifest (KeyError: "
        f"'shards'); rerun the data stage\n"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_a_shard_missing_from_data_is_named(tmp_path, small_data, capsys):
    data = _data_copy(tmp_path, small_data)
    shard = json.loads((data / "manifest.json").read_text())["splits"]["val"]["shards"][0]["name"]
    (data / shard).unlink()
    assert run_train(tmp_path, data) == 2
    assert capsys.readouterr().err == (
        f"clipforge.train: error: {data / shard} not found (1 of the shards manifest.json lists "
        f"are missing): rerun the data stage, or `dvc checkout data`\n"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_a_read_only_checkpoints_folder_is_refused_at_start(tmp_path, small_data, capsys):
    """Even root cannot write to a read-only mount: refused before the model is built."""
    with tmpfs(tmp_path / "disk", 1 << 20) as disk:
        remount(disk, "ro")
        checkpoints = disk / "checkpoints"
        assert run_train(tmp_path, small_data, checkpoints=checkpoints) == 2
        assert capsys.readouterr().err == (
            f"clipforge.train: error: no permission to write {checkpoints} ({disk} is read-only "
            f"or not writable); make it writable or choose another folder\n"
        )
        assert list(disk.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "params.yaml"]
