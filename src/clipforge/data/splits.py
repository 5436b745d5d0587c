"""Train, val and test splits, and the data/ layout written from a stream of pairs.

Train, val and test splits: which split an image lands in, and the data/ layout written from a
stream of pairs too large to hold in memory.

The split is a hash of what identifies an image (its path, URL or shard key), so every caption
of an image lands in the same split and a rerun splits the same way. Sources that stream
(laion-parquet, webdataset) hand every usable pair to a SplitWriter once: it writes train and
val shards as it goes, and parks test images in a temporary shard that becomes the Chinese-CLIP
test set at the end (unless data.test_dir supplies the test set).
"""

from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path

import numpy as np

from clipforge.data import decontam, testset
from clipforge.data.config import DataConfig
from clipforge.data.samples import shorter_side_at_most
from clipforge.data.shards import ShardInfo, ShardReader, ShardWriter, Tokenize, rewrite_shard
from clipforge.errors import StageError
from clipforge.fsutil import sha256_file
from clipforge.metrics.sizes import FEW_QUERIES, MIN_QUERIES, DirectionSize

_PENDING_TEST = ".test-pending"
# A held-out split smaller than MIN_QUERIES measures nothing: the contrastive loss of one pair is
# 0 and the recall over one image 100%. Below FEW_QUERIES, recall@10 is 100% whatever the model.
# The eval stage holds its suites to the same numbers (clipforge.metrics.sizes).
MIN_HELD_OUT, FEW_HELD_OUT = MIN_QUERIES, FEW_QUERIES


def split_of_identity(identity: str, seed: int, val_fraction: float, test_fraction: float) -> str:
    """`train`, `val` or `test` from a hash of what identifies an image (a path, a URL)."""
    return split_of_digest(identity_digest(identity, seed), val_fraction, test_fraction)


def identity_digest(identity: str, seed: int) -> bytes:
    """The hash split_of_identity splits by (its first 8 bytes; the rest are free to use)."""
    return hashlib.sha256(f"{seed}:{identity}".encode()).digest()


def split_of_digest(digest: bytes, val_fraction: float, test_fraction: float) -> str:
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"


def check_held_out_sizes(data: DataConfig, splits: dict, num_images: int | None) -> list[str]:
    """Warnings for a val or test split too small for recall@10; StageError, naming the fraction
    to change, when one is too small to measure anything. num_images: usable images (None: one
    pair per image). A split counts only when its fraction asks for one (0: off), the test split
    only when it is split off here (no data.test_dir)."""
    if num_images is None:
        num_images = sum(splits[s]["count"] for s in ("train", "val"))
        num_images += splits.get("test", {}).get("images", 0)
    held_out = []
    if data.val_fraction:
        held_out.append(("val", splits["val"]["count"], "pairs", data.val_fraction))
    if data.test_fraction and not data.test_dir:
        held_out.append(("test", splits["test"]["images"], "images", data.test_fraction))
    errors, warnings = [], []
    for split, count, unit, fraction in held_out:
        if count >= FEW_HELD_OUT:
            continue
        unit = unit if count != 1 else unit[:-1]
        where = (
            f"the {split} split has {count} {unit} (data.{split}_fraction={fraction:g} of "
            f"{num_images} usable images)"
        )
        remedy = _held_out_remedy(split, num_images)
        if count < MIN_HELD_OUT:
            errors.append(f"{where}: too few to measure anything; {remedy}")
        else:
            warnings.append(
                f"{where}: recall@10 over fewer than {FEW_HELD_OUT} is 100% whatever the "
                f"model; {remedy}"
            )
    if errors:
        raise StageError("\n".join(errors))
    return warnings


def check_given_test_set(sizes: list[DirectionSize]) -> list[str]:
    """The eval stage's rule for a retrieval suite, for a test set given whole (data.test_dir):
    StageError naming each direction that measures nothing, warnings for coarse ones."""
    errors = [f"data.test_dir: {p}" for p in (s.problem() for s in sizes) if p]
    if errors:
        raise StageError("\n".join(errors))
    return [f"data.test_dir: {w}" for w in (s.warning() for s in sizes) if w]


class SeenPairs:
    """Identical pairs (the same image bytes and caption, under any path): the first is kept and
    the others counted, so that no copy of a training pair lands in the val or test split."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()
        self.duplicates = 0

    def first_time(self, image: bytes, caption: str) -> bool:
        key = hashlib.sha256(hashlib.sha256(image).digest() + caption.encode("utf-8")).digest()
        if key in self._seen:
            self.duplicates += 1
            return False
        self._seen.add(key)
        return True

    def warning(self) -> str | None:
        if not self.duplicates:
            return None
        return (
            f"{self.duplicates} pairs are copies of another pair (same image, same caption): "
            f"each is kept once, so that none is scored on an image it was trained on"
        )


def _held_out_remedy(split: str, num_images: int) -> str:
    other = (
        "set data.test_dir to a test set"
        if split == "test"
        else "set data.val_fraction: 0 to train without validation"
    )
    # 1.5 x the minimum: the split is a hash of each image, so its size varies around the share
    wanted = math.ceil(150 * FEW_HELD_OUT / max(num_images, 1)) / 100
    if wanted >= 0.5:  # the fractions stay below 0.5
        return f"add images, or {other}"
    return f"raise data.{split}_fraction to about {wanted:g}, or {other}"


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
    """Writes each pair into its split as it comes. With data.decontaminate, every train and val
    image is pHashed as it is written (8 bytes a pair kept), and once the test set is known (at
    the end when it is split off here) the matches are counted and, with `drop`, their shards
    re-written without them: matches are rare, so few shards are."""

    def __init__(self, out: Path, data: DataConfig, tokenize: Tokenize | None = None):
        self.out = out
        self.data = data
        self.seed = data.seed
        self.resize_to = data.resize_to
        self.val_fraction = data.val_fraction
        self.test_fraction = 0.0 if data.test_dir else data.test_fraction
        self.writers = {
            split: ShardWriter(out, split, data.samples_per_shard, tokenize)
            for split in ("train", "val")
        }  # the test set is read by the eval stage, which tokenises its own
        if self.test_fraction:
            self.writers["test"] = ShardWriter(out, _PENDING_TEST, data.samples_per_shard)
        self.counts = {split: 0 for split in self.writers}
        self.phashes: dict[str, list[int]] = {"train": [], "val": []}
        self.decontamination = decontam.not_checked("data.decontaminate: off")

    def add(self, identity: str, jpeg: bytes, caption: str) -> str:
        """Write one pair; returns its split."""
        split = split_of_identity(identity, self.seed, self.val_fraction, self.test_fraction)
        if split != "test":  # the test set keeps its images as they are
            if self.data.decontaminate != "off":  # the image as it came, before any resize
                phash = decontam.image_hash(jpeg, self.data.max_image_pixels)
                self.phashes[split].append(decontam.NO_HASH if phash is None else phash)
            jpeg = shorter_side_at_most(jpeg, self.resize_to)
        self.writers[split].write(f"{split}-{self.counts[split]:08d}", jpeg, caption)
        self.counts[split] += 1
        return split

    def close(self) -> dict:
        """The manifest's `splits` entries (test only when it was split off here); the
        decontamination record is then in self.decontamination."""
        shards = {split: self.writers[split].close() for split in ("train", "val")}
        test = None
        if "test" in self.writers:
            pending = self.writers["test"].close()
            test = self._write_test_set(pending)
        if self.data.decontaminate != "off":
            test_dir = Path(self.data.test_dir) if self.data.test_dir else self.out / "test"
            self.decontamination = decontaminate_shards(
                self.out, shards, self.phashes, test_dir, self.data
            )
        splits = {split: shard_summary(infos) for split, infos in shards.items()}
        if test is not None:
            splits["test"] = test
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


def decontaminate_shards(
    out: Path,
    shards: dict[str, list[ShardInfo]],
    phashes: dict[str, list[int]],
    test_dir: Path,
    data: DataConfig,
) -> dict:
    """The written train and val shards' images (`phashes`: each sample's pHash, in order)
    against the test set in test_dir (as clipforge.data.inplace compares them); with `drop`, the
    matches' shards are re-written without them (`shards` updated). The manifest's record."""
    tests = testset.load_test_set(test_dir)
    test = decontam.TestHashes.of(
        zip(tests.image_ids, tests.images), data.max_image_pixels, test_hashes(test_dir)["sha256"]
    )
    findings = decontam.Findings(
        data.decontaminate, data.decontaminate_max_distance, len(test.image_ids), test.sha256
    )
    for split, infos in shards.items():
        hashes = np.array(phashes[split], dtype=np.uint64)
        findings.checked += len(hashes)
        if not len(hashes) or not len(test.image_ids):
            continue
        closest = decontam.closest_matches(hashes, test.phashes, data.decontaminate_max_distance)
        by_shard: dict[int, dict[int, tuple[int, int]]] = {}
        for row, match in closest.items():  # every shard but the last holds samples_per_shard
            number, index = divmod(row, data.samples_per_shard)
            by_shard.setdefault(number, {})[index] = match
        for number, matches in sorted(by_shard.items()):
            info = infos[number]
            reader = ShardReader([out / info.name])
            for index, (column, distance) in sorted(matches.items()):
                # the image as written: resized by data.resize_to, a copy counts as near
                image = decontam.open_image(reader.read(0, index)["jpg"], data.max_image_pixels)
                pixels = decontam.pixel_hash(image) if image is not None else None
                kind = "exact" if pixels == test.pixel_hashes[column] else "near"
                where = f"{info.name}:{split}-{number * data.samples_per_shard + index:08d}"
                findings.add(where, split, test.image_ids[column], distance, kind)
            if data.decontaminate == "drop":
                infos[number] = rewrite_shard(out, info, set(matches))
    return findings.to_dict()


def written_phashes(out: Path, infos: list[ShardInfo], max_pixels: int) -> list[int]:
    """The pHash of every image of written shards, in order (NO_HASH where none): for a source
    whose writer took none as it went (`local`, checked only within a mixture)."""
    reader = ShardReader([out / info.name for info in infos])
    hashes = []
    for shard, info in enumerate(infos):
        for index in range(info.count):
            phash = decontam.image_hash(reader.read(shard, index)["jpg"], max_pixels)
            hashes.append(decontam.NO_HASH if phash is None else phash)
    return hashes
