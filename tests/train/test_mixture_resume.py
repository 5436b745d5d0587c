"""Exact resume on a mixture: a run over two weighted sources, one used in place and one copied
from a local folder, is killed with SIGKILL and rerun; it ends with the weights of an
uninterrupted run."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from clipforge.data.stage import main as data_main
from tests.conftest import run_train, train_argv, write_params
from tests.support.killed_run import assert_same_export, rerun_after_sigkill

# Three small CPU runs (90 s on 2 shared cores): in make test-tier3, as the in-place resume. make test keeps the mixture's
# batches equal from step 0 and from a resume (test_mixture_order.py) and exact resume itself
# (test_resume.py).
pytestmark = [pytest.mark.slow, pytest.mark.tier3]


def _local_folder(small_data: Path, folder: Path) -> None:
    """small_data's validation pairs as a folder of images with same-named .txt captions."""
    folder.mkdir()
    for tar in sorted((small_data / "val").glob("*.tar")):
        with tarfile.open(tar) as archive:
            for member in archive.getmembers():
                key, _, ext = member.name.partition(".")
                if ext in ("jpg", "txt"):
                    payload = archive.extractfile(member).read()  # type: ignore[union-attr]
                    (folder / f"{tar.stem}-{key}.{ext}").write_bytes(payload)


@pytest.fixture(scope="module")
def mixture_data(tmp_path_factory, small_data) -> Path:
    root = tmp_path_factory.mktemp("mixture-resume")
    shards = root / "shards"
    shards.mkdir()
    for tar in sorted((small_data / "train").glob("*.tar")):
        shutil.copyfile(tar, shards / tar.name)
    _local_folder(small_data, root / "own")
    params = {
        "data": {
            "source": "mixture",
            "mixture": [
                {"name": "shards", "source": "webdataset", "paths": [f"{shards}/*.tar"]}
                | {"weight": 2},
                {"name": "own", "source": "local", "path": str(root / "own"), "weight": 1},
            ],
            "in_place": True,  # the shards where they are; the local folder is always copied
            "val_fraction": 0.1,
            "test_dir": str(small_data / "test"),
        }
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert data_main(["--params", str(root / "params.yaml"), "--out", str(root / "data")]) == 0
    return root / "data"


def test_sigkill_then_rerun_on_a_mixture_matches_an_uninterrupted_run(tmp_path, mixture_data):
    manifest = json.loads((mixture_data / "manifest.json").read_text())
    parts = manifest["splits"]["train"]["mixture"]
    assert [(p["name"], p["in_place"]) for p in parts] == [("shards", True), ("own", False)]

    reference = tmp_path / "reference"
    reference.mkdir()
    assert run_train(reference, mixture_data) == 0

    killed = tmp_path / "killed"
    killed.mkdir()
    argv = train_argv(killed, mixture_data, write_params(killed / "params.yaml"))
    command = [sys.executable, "-m", "clipforge.train", *argv]
    # Step 7 is held until a stop that never comes: the kill lands after the step-4 checkpoint.
    info = rerun_after_sigkill(command, killed, 7)
    assert info["resumed_from_step"] == 4
    assert_same_export(reference, killed)
