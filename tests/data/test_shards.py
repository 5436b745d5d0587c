"""Shards are written with webdataset's TarWriter, rotated by count, and read back by position."""

from __future__ import annotations

import webdataset as wds

from clipforge.data.shards import ShardReader, ShardWriter
from clipforge.fsutil import sha256_file
from tests.support.imageserver import jpeg_for


def test_shards_rotate_and_read_back_by_position_and_with_webdataset(tmp_path):
    samples = [(f"train-{i:08d}", jpeg_for(str(i)), f"第{i}张图片") for i in range(5)]
    writer = ShardWriter(tmp_path, "train", samples_per_shard=2)
    for sample in samples:
        writer.write(*sample)
    shards = writer.close()
    assert [(s.name, s.count) for s in shards] == [
        ("train/shard-000000.tar", 2),
        ("train/shard-000001.tar", 2),
        ("train/shard-000002.tar", 1),
    ]
    assert all(sha256_file(tmp_path / s.name) == s.sha256 for s in shards)

    reader = ShardReader([tmp_path / s.name for s in shards])
    assert reader.read(1, 1) == {"jpg": samples[3][1], "txt": samples[3][2].encode()}
    # and any webdataset pipeline reads the same samples, in order
    read = list(wds.WebDataset([str(tmp_path / s.name) for s in shards], shardshuffle=False))
    assert [(r["__key__"], r["txt"].decode()) for r in read] == [(k, c) for k, _, c in samples]


def test_resize_to_brings_the_shorter_side_down_and_leaves_small_images_alone():
    """data.resize_to: a 384x256 image sharded at the model's 224; a smaller one untouched."""
    import io

    from PIL import Image

    from clipforge.data.builtin import encode_jpeg
    from clipforge.data.samples import shorter_side_at_most

    large = encode_jpeg(Image.new("RGB", (384, 256), "red"))
    small = encode_jpeg(Image.new("RGB", (200, 100), "blue"))
    assert Image.open(io.BytesIO(shorter_side_at_most(large, 224))).size == (336, 224)
    assert shorter_side_at_most(small, 224) == small
    assert shorter_side_at_most(large, None) == large
