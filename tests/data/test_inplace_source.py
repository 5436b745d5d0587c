"""Shards used in place: a read-only directory of webdataset shards (good, bad, cut short, not a
tar, and one with test images planted: a copy, a re-encoding, a resize) indexed by the data stage
over two processes; the train stage's reader serves the original bytes from there."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import yaml
from PIL import Image

from clipforge.data import testset
from clipforge.data.decontam import eval_record
from clipforge.data.inplace import shard_samples
from clipforge.data.shards import ShardChangedError
from clipforge.data.stage import main
from clipforge.train.loader import split_files
from tests.data.test_wds_source import data_stage_on_bombs, make_shards
from tests.support.imageserver import jpeg_for
from tests.support.shards import textured_jpeg, write_tar


def reencoded(jpeg: bytes, scale: float, quality: int) -> bytes:
    image = Image.open(io.BytesIO(jpeg)).convert("RGB")
    image = image.resize((round(image.width * scale), round(image.height * scale)))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


TEST_SEEDS = range(100, 106)
PLANTED = {  # key in the training shard -> (test image id, how it was changed)
    "p-exact": (0, "copy"),
    "p-reencoded": (1, "quality 40"),
    "p-resized": (2, "half size, quality 70"),
}


def make_planted_shard(path: Path) -> dict[str, bytes]:
    tests = {i: textured_jpeg(seed) for i, seed in enumerate(TEST_SEEDS)}
    members, images = [], {}
    for n in range(20):
        images[f"q-{n:03d}"] = textured_jpeg(n)
    images["p-exact"] = tests[0]
    images["p-reencoded"] = reencoded(tests[1], 1.0, 40)
    images["p-resized"] = reencoded(tests[2], 0.5, 70)
    for key, jpeg in images.items():
        members += [(f"{key}.jpg", jpeg), (f"{key}.txt", f"照片 {key}".encode())]
    write_tar(path, members)
    return images


def make_read_only(directory: Path) -> None:
    for path in directory.iterdir():
        path.chmod(stat.S_IRUSR | stat.S_IRGRP)
    directory.chmod(stat.S_IRUSR | stat.S_IXUSR)


@pytest.fixture(scope="module")
def in_place_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("in-place")
    expected = make_shards(root / "shards")
    images = make_planted_shard(root / "shards" / "shard-0004.tar")
    tests = [(i, textured_jpeg(seed), [f"测试 {i}"]) for i, seed in enumerate(TEST_SEEDS)]
    testset.write_test_set(root / "flickr", tests)
    make_read_only(root / "shards")
    params = {
        "data": {
            "source": "webdataset",
            "paths": [f"{root}/shards/shard-{{0000..0004}}.tar"],
            "in_place": True,
            "verify": "all",
            "workers": 2,
            "val_fraction": 0.25,
            "test_dir": str(root / "flickr"),
        }
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    try:
        assert main(["--params", str(root / "params.yaml"), "--out", str(root / "data")]) == 0
        manifest = json.loads((root / "data" / "manifest.json").read_text(encoding="utf-8"))
        yield {"root": root, "expected": expected, "manifest": manifest, "images": images}
    finally:
        (root / "shards").chmod(stat.S_IRWXU)


def _all_samples(data: Path) -> dict[str, dict[str, bytes]]:
    """caption -> sample, over train and val, through the train stage's reader."""
    found = {}
    for split in ("train", "val"):
        files = split_files(data, split)
        reader = files.reader()
        for shard, count in enumerate(files.counts):
            for index in range(count):
                sample = reader.read(shard, index)
                found[sample["txt"].decode()] = sample
    return found


def test_data_holds_an_index_and_no_image(in_place_run):
    """data/ has the manifest, the per-shard indexes and the test set, and no shard: in place."""
    data = in_place_run["root"] / "data"
    names = {p.relative_to(data).as_posix() for p in data.rglob("*") if p.is_file()}
    assert not [n for n in names if n.endswith(".tar")]
    assert {"manifest.json", "test/test_imgs.tsv"} <= names
    assert all(s["name"] in names for s in in_place_run["manifest"]["splits"]["train"]["shards"])


def test_skip_reasons_are_those_of_the_copying_source(in_place_run):
    """Bad samples, the cut shard and the non-tar are skipped by the same reasons as a copy."""
    counts = in_place_run["manifest"]["skipped"]["counts"]
    assert counts == {**in_place_run["expected"]["bad"], "corrupt_shard": 2}


def test_each_shard_has_its_identity_and_counts_in_the_manifest(in_place_run):
    """Per shard: size, mtime, a sampled hash, samples read and kept, the error if any."""
    shards = {Path(s["shard"]).name: s for s in in_place_run["manifest"]["source"]["shards"]}
    good = shards["shard-0000.tar"]
    assert (good["samples"], good["kept"], good["error"]) == (12, 12, None)
    assert good["identity"]["size"] == os.path.getsize(good["shard"])
    assert good["identity"]["mtime_ns"] and len(good["identity"]["sampled_sha256"]) == 64
    assert (
        shards["shard-0002.tar"]["kept"] == 2 and "ends inside" in shards["shard-0002.tar"]["error"]
    )
    assert shards["shard-0003.tar"]["samples"] == 0 and shards["shard-0003.tar"]["error"]


def test_the_reader_serves_the_original_bytes(in_place_run):
    """Every kept sample (the PNG as PNG) comes back byte for byte from the read-only shards."""
    expected = in_place_run["expected"]
    samples = _all_samples(in_place_run["root"] / "data")
    for key in expected["good"]:
        assert samples[f"好图片 {key}"]["jpg"] == jpeg_for(key)
    assert {f"截断 {k}" for k in expected["cut_kept"]} <= set(samples)
    assert samples["PNG 图片"]["jpg"].startswith(b"\x89PNG")
    for key, jpeg in in_place_run["images"].items():
        if key.startswith("q-"):
            assert samples[f"照片 {key}"]["jpg"] == jpeg


def test_planted_test_images_are_found_and_dropped(in_place_run):
    """The copy is found as exact, the re-encoded and the resized one as near duplicates; all
    three are left out of train and val, and the manifest names them."""
    record = in_place_run["manifest"]["decontamination"]
    assert record["checked"] and record["mode"] == "drop"
    assert record["found"] == {"exact": 1, "near": 2, "total": 3}
    assert record["dropped"] == 3 and record["test_images_found"] == 3
    found = {e["sample"].rsplit(":", 1)[1]: e for e in record["examples"]}
    assert {k: (e["test_image_id"], e["kind"]) for k, e in found.items()} == {
        "p-exact": (0, "exact"),
        "p-reencoded": (1, "near"),
        "p-resized": (2, "near"),
    }
    samples = _all_samples(in_place_run["root"] / "data")
    assert not [c for c in samples if c.startswith("照片 p-")]
    assert len([c for c in samples if c.startswith("照片 q-")]) == 20  # no false match


def test_eval_learns_whether_its_test_set_was_checked(in_place_run, tmp_path):
    """eval_record: checked against this test set with the findings; another test set: not."""
    root = in_place_run["root"]
    record = eval_record(root / "data" / "manifest.json", root / "data" / "test")
    assert record["checked"] and record["against_this_test_set"]
    assert record["found"]["total"] == 3
    testset.write_test_set(tmp_path / "other", [(0, textured_jpeg(7), ["别的"])])
    other = eval_record(root / "data" / "manifest.json", tmp_path / "other")
    assert not other["checked"] and "another test set" in other["reason"]


def test_a_shard_changed_after_indexing_is_an_error_naming_it(in_place_run, tmp_path):
    """Training from a manifest whose shard has since been rewritten stops, naming the shard."""
    shards = tmp_path / "shards"
    shutil.copytree(in_place_run["root"] / "shards", shards)
    for path in shards.iterdir():
        path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    manifest = in_place_run["manifest"]
    text = json.dumps(manifest).replace(str(in_place_run["root"] / "shards"), str(shards))
    data = tmp_path / "data"
    shutil.copytree(in_place_run["root"] / "data", data)
    data.joinpath("manifest.json").write_text(text, encoding="utf-8")
    for entry in json.loads(text)["splits"]["train"]["shards"]:  # the copies' own identities
        os.utime(entry["url"], ns=(entry["identity"]["mtime_ns"],) * 2)
    split_files(data, "train")  # unchanged: fine
    victim = shards / "shard-0000.tar"
    victim.write_bytes(victim.read_bytes() + b"\0" * 1024)
    with pytest.raises(ShardChangedError, match=f"{victim}: its size was"):
        split_files(data, "train")


def _tarfile_samples(path: Path) -> list[tuple[bytes, dict[bytes, tuple[int, int]]]]:
    import tarfile

    found: dict[bytes, dict[bytes, tuple[int, int]]] = {}
    with tarfile.open(path) as tar:
        for info in tar:
            if info.isfile():
                stem, _, ext = info.name.rpartition("/")[2].partition(".")
                directory = info.name.rpartition("/")[0]
                key = f"{directory}/{stem}" if directory else stem
                found.setdefault(key.encode(), {})[ext.encode()] = (info.offset_data, info.size)
    return list(found.items())


def test_headers_are_read_like_tarfile_reads_them(in_place_run, tmp_path):
    """The shard reader finds the samples tarfile finds, at the same offsets, with the captions'
    bytes: in ustar shards, and in one whose second half has PAX headers (long names), which it
    hands to tarfile from the first sample that has one."""
    mixed = tmp_path / "mixed.tar"
    members = []
    for n in range(6):
        key = f"k{n}" if n < 3 else f"dir/{'long' * 30}-{n}"
        members += [(f"{key}.jpg", textured_jpeg(n)), (f"{key}.txt", f"照片 {n}".encode())]
    write_tar(mixed, members)
    for path in (in_place_run["root"] / "shards" / "shard-0004.tar", mixed):
        with open(path, "rb") as f:
            ours = list(shard_samples(f, path.stat().st_size))
            assert [(key, found) for key, found, _ in ours] == _tarfile_samples(path)
            for _, found, caption in ours:
                f.seek(found[b"txt"][0])
                assert caption in (None, f.read(found[b"txt"][1]))


def test_a_test_split_taken_from_the_shards_is_written_out(tmp_path):
    """Without data.test_dir, the test share of the samples becomes data/test (Chinese-CLIP
    layout, readable by eval), and train + val + test hold every kept sample once."""
    shards = tmp_path / "shards"
    shards.mkdir()
    make_planted_shard(shards / "shard-0000.tar")
    params = {
        "data": {
            "source": "webdataset",
            "paths": [f"{shards}/*.tar"],
            "in_place": True,
            "workers": 1,
            "val_fraction": 0.2,
            "test_fraction": 0.3,
        }
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "data")]) == 0
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text(encoding="utf-8"))
    splits = manifest["splits"]
    test = testset.load_test_set(tmp_path / "data" / "test")
    assert len(test.image_ids) == splits["test"]["images"] > 0
    found = manifest["decontamination"]["found"]["total"]  # test images again in train/val
    assert splits["train"]["count"] + splits["val"]["count"] + len(test.image_ids) + found == 23


def test_shards_behind_an_fsspec_url_are_read_and_checked_by_listing(tmp_path):
    """file:// URLs go through fsspec like s3://: indexed, read back, and a rewritten shard is
    found by the directory listing and named."""
    shards = tmp_path / "shards"
    shards.mkdir()
    images = make_planted_shard(shards / "shard-0000.tar")
    params = {
        "data": {
            "source": "webdataset",
            "paths": [f"file://{shards}/shard-*.tar"],
            "in_place": True,
            "workers": 1,
            "val_fraction": 0.0,
            "test_fraction": 0.2,
            "decontaminate": "off",
        }
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "data")]) == 0
    files = split_files(tmp_path / "data", "train")
    assert files.in_place[0]["url"].startswith("file://")
    sample = files.reader().read(0, 0)
    assert sample["jpg"] in images.values()
    victim = shards / "shard-0000.tar"
    victim.write_bytes(victim.read_bytes() + b"\0" * 1024)
    with pytest.raises(ShardChangedError, match="shard-0000.tar: its size was"):
        split_files(tmp_path / "data", "train")


def test_members_declaring_gigabytes_are_skipped_unread_in_place(tmp_path):
    """In place, as copied: the hollow shard's 4 GiB image and 1 GiB caption (read whole before:
    2.1 GB) are skipped by their header sizes, counted as too_large, and the 1 GiB PAX header
    ends its shard as corrupt_shard, in under 1 GB; the sparse member is no regular file to a
    shard read in place (its sample has no image)."""
    shards = ["sparse", "hollow", "pax"]
    counts, read_kept = data_stage_on_bombs(tmp_path, shards, in_place=True, verify="all")
    assert counts == {"too_large": 1, "missing_image": 1, "corrupt_shard": 1}
    assert read_kept == [(3, 2), (3, 2), (1, 1)]  # the sample the header may belong to: cut
