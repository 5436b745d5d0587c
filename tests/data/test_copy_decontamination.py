"""Copied shards (data.in_place: false) are checked against the test set as shards used in place
are: test images planted into a training shard (a copy, a re-encoding, a resize) are found,
counted in the manifest and dropped from the copied train and val shards."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import yaml

from clipforge.data import testset
from clipforge.data.decontam import eval_record
from clipforge.data.stage import main
from tests.data.test_inplace_source import TEST_SEEDS, make_planted_shard
from tests.support.shards import textured_jpeg


def _copy(tmp_path: Path, **knobs) -> tuple[Path, dict]:
    shards = tmp_path / "shards"
    shards.mkdir()
    make_planted_shard(shards / "shard-0000.tar")
    params = {
        "data": {
            "source": "webdataset",
            "paths": [f"{shards}/*.tar"],
            "in_place": False,
            "samples_per_shard": 4,  # several shards: only those with a match are re-written
            **knobs,
        }
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "data")]) == 0
    data = tmp_path / "data"
    return data, json.loads((data / "manifest.json").read_text(encoding="utf-8"))


def _flickr(tmp_path: Path) -> Path:
    tests = [(i, textured_jpeg(seed), [f"测试 {i}"]) for i, seed in enumerate(TEST_SEEDS)]
    testset.write_test_set(tmp_path / "flickr", tests)
    return tmp_path / "flickr"


def _captions(data: Path, manifest: dict) -> list[str]:
    """Every caption in the copied train and val shards, which must match the manifest."""
    found = []
    for split in ("train", "val"):
        for shard in manifest["splits"][split]["shards"]:
            with tarfile.open(data / shard["name"]) as tar:
                names = [m for m in tar.getmembers() if m.name.endswith(".txt")]
                assert len(names) == shard["count"]
                found += [tar.extractfile(m).read().decode() for m in names]
    return found


@pytest.mark.parametrize("mode", ["drop", "report"])
def test_planted_test_images_are_found_in_a_copy_and_dropped_or_reported(tmp_path, mode):
    """The copy is exact, the re-encoded and the resized one near; `drop` leaves them out of the
    copied shards (and no other image), `report` keeps them; eval learns the set was checked."""
    data, manifest = _copy(
        tmp_path, test_dir=str(_flickr(tmp_path)), val_fraction=0.2, decontaminate=mode
    )
    record = manifest["decontamination"]
    assert record["checked"] and record["mode"] == mode and record["samples_checked"] == 23
    assert record["found"] == {"exact": 1, "near": 2, "total": 3}
    assert record["dropped"] == (3 if mode == "drop" else 0)
    assert sorted((e["test_image_id"], e["kind"]) for e in record["examples"]) == [
        (0, "exact"),
        (1, "near"),
        (2, "near"),
    ]
    captions = _captions(data, manifest)
    planted = [c for c in captions if c.startswith("照片 p-")]
    assert len(planted) == (0 if mode == "drop" else 3)
    assert len([c for c in captions if c.startswith("照片 q-")]) == 20  # no false match
    assert manifest["splits"]["train"]["count"] + manifest["splits"]["val"]["count"] == (
        len(captions)
    )
    evaluated = eval_record(data / "manifest.json", data / "test")
    assert evaluated["checked"] and evaluated["found"]["total"] == 3


def test_a_test_split_taken_from_a_copy_is_checked_once_it_is_written(tmp_path):
    """Without data.test_dir the test set is known only at the end: train and val images that
    match it are found then, and every kept sample is in exactly one split."""
    data, manifest = _copy(tmp_path, val_fraction=0.2, test_fraction=0.3)
    splits, record = manifest["splits"], manifest["decontamination"]
    assert record["checked"] and record["test_images"] == splits["test"]["images"] > 0
    assert len(_captions(data, manifest)) == splits["train"]["count"] + splits["val"]["count"]
    found = record["found"]["total"]
    assert (
        splits["train"]["count"] + splits["val"]["count"] + splits["test"]["images"] + found == 23
    )


def test_decontaminate_off_leaves_a_copy_unchecked_and_says_so(tmp_path):
    """`off`: nothing hashed, nothing dropped, and the manifest says it was not checked."""
    data, manifest = _copy(tmp_path, test_dir=str(_flickr(tmp_path)), decontaminate="off")
    assert manifest["decontamination"] == {"checked": False, "reason": "data.decontaminate: off"}
    assert len([c for c in _captions(data, manifest) if c.startswith("照片 p-")]) == 3
