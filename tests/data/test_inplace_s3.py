"""Shards used in place on S3 (moto's real S3 API, reached by s3fs as any endpoint): the data stage
indexes them by their s3:// URLs and writes only the manifest and the index; the train stage's
reader serves the original bytes from the bucket; a shard overwritten since (same size, other
bytes: a new etag) stops training with an error naming it."""

from __future__ import annotations

import json

import pytest
import yaml

from clipforge.data.inplace import read_index
from clipforge.data.shards import ShardChangedError, open_shard
from clipforge.data.stage import main
from clipforge.train.loader import split_files
from tests.conftest import run_train
from tests.data.test_inplace_source import make_planted_shard


@pytest.fixture
def s3_shards(s3, tmp_path):
    """Two shards in a fresh bucket; (bucket URL, {caption: image bytes})."""
    bucket = s3.new_bucket()
    fs = s3.filesystem()
    images = {}
    for n in range(2):
        local = tmp_path / f"shard-{n}.tar"
        for key, jpeg in make_planted_shard(local).items():
            images[f"照片 {key}"] = jpeg  # the same images in both shards: keyed by caption
        fs.put_file(str(local), f"{bucket}/shards/shard-{n}.tar"[len("s3://") :])
    return bucket, images


def _index(tmp_path, bucket: str) -> dict:
    params = {
        "data": {
            "source": "webdataset",
            "paths": [f"{bucket}/shards/shard-*.tar"],
            "in_place": True,
            "workers": 2,
            "verify": "all",
            "val_fraction": 0.2,
            "test_fraction": 0.2,
        }
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "data")]) == 0
    return json.loads((tmp_path / "data" / "manifest.json").read_text(encoding="utf-8"))


def test_s3_shards_are_indexed_in_place_and_read_back_from_the_bucket(s3_shards, tmp_path):
    """The manifest names each s3:// shard with its etag; data/ holds no shard; every train and
    val sample read through the train stage's reader is the original image."""
    bucket, images = s3_shards
    manifest = _index(tmp_path, bucket)
    shards = manifest["source"]["shards"]
    assert [s["shard"] for s in shards] == [f"{bucket}/shards/shard-{n}.tar" for n in range(2)]
    assert all(s["identity"]["etag"] and s["samples"] == s["kept"] == 23 for s in shards)
    assert not list((tmp_path / "data").rglob("*.tar"))
    read = 0
    for split in ("train", "val"):
        files = split_files(tmp_path / "data", split)
        reader = files.reader()
        for shard, count in enumerate(files.counts):
            assert files.in_place[shard]["url"].startswith(bucket)
            for index in range(count):
                sample = reader.read(shard, index)
                assert sample["jpg"] == images[sample["txt"].decode()]
                read += 1
    assert read == manifest["splits"]["train"]["count"] + manifest["splits"]["val"]["count"] > 0
    # large shards are read a sample at a time (no read-ahead): the same bytes, backwards too
    locations = read_index(tmp_path / "data" / files.paths[0].relative_to(tmp_path / "data"))
    with open_shard(files.in_place[0]["url"], random_access=True) as f:
        for image_at, image_size, _, _ in locations[::-1].tolist():
            f.seek(image_at)
            assert f.read(image_size) in images.values()


def test_an_s3_shard_overwritten_since_indexing_is_an_error_naming_it(s3, s3_shards, tmp_path):
    """Same size, other bytes: the etag differs, and both the start-up check and a reader that
    opens the shard name it."""
    bucket, _ = s3_shards
    _index(tmp_path, bucket)
    files = split_files(tmp_path / "data", "train")  # unchanged: fine
    fs = s3.filesystem()
    victim = f"{bucket}/shards/shard-1.tar"
    payload = bytearray(fs.cat_file(victim[len("s3://") :]))
    payload[-2000] ^= 0xFF  # inside the last image: the tar still parses
    fs.pipe_file(victim[len("s3://") :], bytes(payload))
    with pytest.raises(ShardChangedError, match=f"{victim}: its etag was"):
        split_files(tmp_path / "data", "train")
    shard = [e["url"] for e in files.in_place].index(victim)
    with pytest.raises(ShardChangedError, match=f"{victim} changed since the data stage"):
        files.reader().read(shard, 0)


@pytest.mark.tier2
def test_the_train_stage_trains_from_s3_shards_in_place(s3, small_data, tmp_path):
    """The whole path: the small data's shards put in a bucket, indexed in place by the data
    stage, and the train stage (loader workers included) trains from the bucket to the end."""
    bucket = s3.new_bucket()
    fs = s3.filesystem()
    for split in ("train", "val"):
        for tar in sorted((small_data / split).glob("*.tar")):
            fs.put_file(str(tar), f"{bucket}/shards/{split}-{tar.name}"[len("s3://") :])
    params = {
        "data": {
            "source": "webdataset",
            "paths": [f"{bucket}/shards/*.tar"],
            "in_place": True,
            "decontaminate": "off",
            "val_fraction": 0.1,
            "test_dir": str(small_data / "test"),
        }
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    data = tmp_path / "data"
    assert main(["--params", str(tmp_path / "params.yaml"), "--out", str(data)]) == 0
    assert not list(data.rglob("*.tar"))
    run = tmp_path / "run"
    run.mkdir()
    assert run_train(run, data, "train.num_workers=2") == 0
    info = json.loads((run / "metrics" / "train.info.json").read_text(encoding="utf-8"))
    assert info["skipped_at_read"]["counts"] == {}
    assert (run / "models" / "clip" / "open_clip_model.safetensors").is_file()
