"""Train, val and test splits: which split an image lands in, and the data/ layout written from a
stream of pairs too large to hold in memory.

The split is a hash of what identifies an image (its path, URL or shard key), so every caption
of an image lands in the same split and a rerun splits the same way. Sources that stream
(laion-parquet, webdataset) hand every usable pair to a SplitWriter once: it writes train and
val shards as it goes, and parks test images in a temporary shard that becomes the Chinese-CLIP
test set at the end (unless data.test_dir supplies the test set).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from clipforge.config import DataConfig
from clipforge.data import testset
from clipforge.data.samples import shorter_side_at_most
from clipforge.data.shards import ShardInfo, ShardReader, ShardWriter
from clipforge.fsutil import sha256_file

_PENDING_TEST = ".test-pending"


def split_of_identity(identity: str, seed: int, val_fraction: float, test_fraction: float) -> str:
    """`train`, `val` or `test` from a hash of what identifies an image (a path, a URL)."""
    digest = hashlib.sha256(f"{seed}:{identity}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"


def shard_summary(shards: list[ShardInfo]) -> dict:
    return {
        "count": sum(s.count for s in shards),
        "shards": [{"name": s.name, "count": s.count, "sha256": s.sha256} for s in shards],
    }


def test_hashes(directory: Path) -> dict:
    return {
        "sha256": {
            name: sha256_file(directory / name)
            for name in (testset.IMAGES_FILE, testset.TEXTS_FILE)
        }
    }


class SplitWriter:
    def __init__(self, out: Path, data: DataConfig):
        self.out = out
        self.seed = data.seed
        self.resize_to = data.resize_to
        self.val_fraction = data.val_fraction
        self.test_fraction = 0.0 if data.test_dir else data.test_fraction
        self.writers = {
            split: ShardWriter(out, split, data.samples_per_shard) for split in ("train", "val")
        }
        if self.test_fraction:
            self.writers["test"] = ShardWriter(out, _PENDING_TEST, data.samples_per_shard)
        self.counts = {split: 0 for split in self.writers}

    def add(self, identity: str, jpeg: bytes, caption: str) -> str:
        """Write one pair; returns its split."""
        split = split_of_identity(identity, self.seed, self.val_fraction, self.test_fraction)
        if split != "test":  # the test set keeps its images as they are
            jpeg = shorter_side_at_most(jpeg, self.resize_to)
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
