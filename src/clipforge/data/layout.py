"""The data/ layout written from a stream of pairs too large to hold in memory.

Sources that stream (laion-parquet, webdataset) hand every usable pair to a SplitWriter once:
it picks the split from a hash of what identifies the image (its URL, its shard key), writes
train and val shards as it goes, and parks test images in a temporary shard that becomes the
Chinese-CLIP test set at the end (unless data.test_dir supplies the test set).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from clipforge.config import DataConfig
from clipforge.data import testset
from clipforge.data.local import split_of_identity
from clipforge.data.shards import ShardInfo, ShardReader, ShardWriter
from clipforge.fsutil import sha256_file

_PENDING_TEST = ".test-pending"


def shard_summary(shards: list[ShardInfo]) -> dict:
    return {"count": sum(s.count for s in shards),
            "shards": [{"name": s.name, "count": s.count, "sha256": s.sha256} for s in shards]}


def test_hashes(directory: Path) -> dict:
    return {"sha256": {name: sha256_file(directory / name)
                       for name in (testset.IMAGES_FILE, testset.TEXTS_FILE)}}


class SplitWriter:
    def __init__(self, out: Path, data: DataConfig):
        self.out = out
        self.seed = data.seed
        self.val_fraction = data.val_fraction
        self.test_fraction = 0.0 if data.test_dir else data.test_fraction
        self.writers = {split: ShardWriter(out, split, data.samples_per_shard)
                        for split in ("train", "val")}
        if self.test_fraction:
            self.writers["test"] = ShardWriter(out, _PENDING_TEST, data.samples_per_shard)
        self.counts = {split: 0 for split in self.writers}

    def add(self, identity: str, jpeg: bytes, caption: str) -> str:
        """Write one pair; returns its split."""
        split = split_of_identity(identity, self.seed, self.val_fraction, self.test_fraction)
        self.writers[split].write(f"{split}-{self.counts[split]:08d}", jpeg, caption)
        self.counts[split] += 1
        return split

    def close(self) -> dict:
        """The manifest's `splits` entries (test only when it was split off here)."""
        splits = {split: shard_summary(self.writers[split].close()) for split in ("train", "val")}
        if "test" in self.writers:
            pending = self.writers["test"].close()
            splits["test"] = self._write_test_set(pending)
        return splits

    def _write_test_set(self, pending: list[ShardInfo]) -> dict:
        reader = ShardReader([self.out / s.name for s in pending])

        def images():
            image_id = 0
            for shard, info in enumerate(pending):
                for index in range(info.count):
                    sample = reader.read(shard, index)
                    yield image_id, sample["jpg"], [sample["txt"].decode("utf-8")]
                    image_id += 1

        counts = testset.write_test_set(self.out / "test", images())
        shutil.rmtree(self.out / _PENDING_TEST)
        return {**counts, **test_hashes(self.out / "test")}
