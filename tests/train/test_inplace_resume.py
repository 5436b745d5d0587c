"""Exact resume on shards used in place: a run over a read-only directory of shards, some samples
of which do not decode, is killed with SIGKILL and rerun; it ends with the weights of an
uninterrupted run, and both count the corrupt samples they replaced."""

from __future__ import annotations

import json
import shutil
import stat
import sys
from pathlib import Path

import pytest
import yaml

from clipforge.data.stage import main as data_main
from tests.conftest import run_train, train_argv, write_params
from tests.support.killed_run import assert_same_export, rerun_after_sigkill
from tests.support.shards import write_tar

# Two runs on in-place shards (2.5 minutes beside the other tiers): in make test-tier3. make test
# keeps exact resume (test_resume.py) and the in-place reads (test_inplace_loader.py,
# data/test_inplace_source.py); tier2 a run trained from S3 in place (data/test_inplace_s3.py).
pytestmark = [pytest.mark.slow, pytest.mark.tier3]

CORRUPT = [f"bad-{i}" for i in range(6)]


@pytest.fixture(scope="module")
def in_place_data(tmp_path_factory, small_data) -> Path:
    """The small data's shards, plus one of undecodable JPEGs, read-only, indexed in place."""
    root = tmp_path_factory.mktemp("in-place-resume")
    shards = root / "shards"
    shards.mkdir()
    for split in ("train", "val"):
        for tar in sorted((small_data / split).glob("*.tar")):
            shutil.copyfile(tar, shards / f"{split}-{tar.name}")
    members = []
    for key in CORRUPT:
        members += [(f"{key}.jpg", b"\xff\xd8\xff\xe0 cut short"), (f"{key}.txt", b"broken")]
    write_tar(shards / "zz-corrupt.tar", members)
    for path in shards.iterdir():
        path.chmod(stat.S_IRUSR)
    shards.chmod(stat.S_IRUSR | stat.S_IXUSR)
    params = {
        "data": {
            "source": "webdataset",
            "paths": [f"{shards}/*.tar"],
            "in_place": True,
            "verify": "none",  # the corrupt samples are kept: training meets them
            "decontaminate": "off",
            "val_fraction": 0.1,
            "test_dir": str(small_data / "test"),
        }
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert data_main(["--params", str(root / "params.yaml"), "--out", str(root / "data")]) == 0
    yield root / "data"
    shards.chmod(stat.S_IRWXU)


def test_sigkill_then_rerun_on_in_place_shards_matches_an_uninterrupted_run(
    tmp_path, in_place_data
):
    manifest = json.loads((in_place_data / "manifest.json").read_text())
    corrupt_in_train = [
        s for s in manifest["splits"]["train"]["shards"] if s["url"].endswith("zz-corrupt.tar")
    ]
    assert corrupt_in_train, "no corrupt sample landed in the train split"

    reference = tmp_path / "reference"
    reference.mkdir()
    assert run_train(reference, in_place_data) == 0

    killed = tmp_path / "killed"
    killed.mkdir()
    command = [
        sys.executable,
        "-m",
        "clipforge.train",
        *train_argv(killed, in_place_data, write_params(killed / "params.yaml")),
    ]
    # Step 7 is held until a stop that never comes: the kill lands after the step-4 checkpoint.
    info = rerun_after_sigkill(command, killed, 7)
    assert info["resumed_from_step"] == 4
    assert_same_export(reference, killed)
    reference_info = json.loads((reference / "metrics" / "train.info.json").read_text())
    skipped = reference_info["skipped_at_read"]
    # two epochs: every corrupt train sample met at least twice, each replaced, none fatal
    assert skipped["counts"]["corrupt_image"] >= 2 * corrupt_in_train[0]["count"]
    assert all("zz-corrupt.tar#" in e for e in skipped["examples"]["corrupt_image"])
    assert info["skipped_at_read"]["counts"]["corrupt_image"] >= 1  # after the resume
