"""Decontamination: test-set images found in the training data, before training.

An R@1 measured on images the model trained on is a wrong number. LAION holds Flickr photos and
Flickr30K-CN's test images are Flickr photos, so the data stage compares every train and val
image with every test image:
- near duplicates by a 64-bit DCT perceptual hash (pHash, as the `imagehash` library computes
  it: 32x32 greyscale, 2-D DCT, the 8x8 lowest frequencies against their median), which a
  resize or a JPEG re-encoding moves by a few bits at most; a pair within
  data.decontaminate_max_distance bits is a match;
- exact duplicates, among those matches, by a hash of the decoded pixels (the same picture in
  another file, a re-written EXIF, a renamed copy).

Both hashes of a candidate are taken from its decoded pixels, so the check needs every image
read once (the cost BENCHMARKS.md measures); JPEGs are decoded at reduced scale (PIL's draft
mode), which the pHash, made from 32x32 pixels, does not notice.

The findings go into the manifest (`decontamination`: counts, examples, and the sha256 of the
test set checked against); `eval_record` tells the eval stage whether the model's training data
was checked against the test set it evaluates on.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from clipforge.data import testset
from clipforge.fsutil import sha256_file

HASH_SIDE = 32  # pHash: the DCT of a 32x32 greyscale image...
LOW_FREQUENCIES = 8  # ...of which the 8x8 lowest frequencies make the 64 bits
MAX_EXAMPLES = 20
NO_HASH = 0  # no image's pHash: half its bits are set; flat and undecodable images get this
FLAT_STD = 2.0  # grey levels: below, an image is flat (a pHash from noise); only exact checks
_MATCH_CHUNK = 4096  # train hashes compared at once: a 4096 x T matrix of distances


@lru_cache(maxsize=1)
def _dct_matrix() -> np.ndarray:
    """The orthonormal DCT-II matrix of size HASH_SIDE (scipy.fftpack.dct's, norm="ortho"):
    pHash's ranking of coefficients against their median does not depend on the scale."""
    n = HASH_SIDE
    k = np.arange(n)[:, None]
    x = np.arange(n)[None, :]
    matrix = np.cos(np.pi * (2 * x + 1) * k / (2 * n)) * np.sqrt(2 / n)
    matrix[0] /= np.sqrt(2)
    return matrix


def perceptual_hash(image: Image.Image) -> int:
    """The 64-bit pHash of a decoded image (bit 63: the DC coefficient's); NO_HASH for a flat
    image, whose bits would be rounding noise that matches every other flat image."""
    grey = image.convert("L").resize((HASH_SIDE, HASH_SIDE), Image.Resampling.LANCZOS)
    pixels = np.asarray(grey, dtype=np.float64)
    if pixels.std() < FLAT_STD:
        return NO_HASH
    dct = _dct_matrix() @ pixels @ _dct_matrix().T
    low = dct[:LOW_FREQUENCIES, :LOW_FREQUENCIES].ravel()
    bits = low > np.median(low)
    return int(np.packbits(bits).view(">u8")[0])


def pixel_hash(image: Image.Image) -> str:
    """sha256 of the decoded RGB pixels and the size: the same picture whatever its file."""
    rgb = image.convert("RGB")
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def open_image(raw: bytes, max_pixels: int, draft: bool = False) -> Image.Image | None:
    """The decoded image, or None when it does not decode or has more than max_pixels.
    draft: a JPEG decoded at the smallest scale (1/2 to 1/8) still at least the hash's side."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            if image.width * image.height > max_pixels:
                return None
            if draft and image.format == "JPEG":
                image.draft("RGB", (HASH_SIDE, HASH_SIDE))
            image.load()
            return image
    except Exception:  # PIL raises many types for broken files: all mean "not an image" here
        return None


def image_hash(raw: bytes, max_pixels: int) -> int | None:
    """The pHash of an image file (reduced-scale decode), None when it does not decode."""
    image = open_image(raw, max_pixels, draft=True)
    return None if image is None else perceptual_hash(image)


def hamming_matches(
    hashes: np.ndarray, targets: np.ndarray, max_distance: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index into hashes, index into targets, distance) of every pair within max_distance bits;
    uint64 arrays, compared a chunk at a time so memory stays at _MATCH_CHUNK x len(targets)."""
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    targets = np.asarray(targets, dtype=np.uint64)
    target_columns = np.nonzero(targets != NO_HASH)[0]
    targets = targets[target_columns]
    for start in range(0, len(hashes), _MATCH_CHUNK):
        chunk = np.asarray(hashes[start : start + _MATCH_CHUNK], dtype=np.uint64)
        distance = np.bitwise_count(chunk[:, None] ^ targets[None, :])
        distance[chunk == NO_HASH] = 65  # matches nothing
        rows, columns = np.nonzero(distance <= max_distance)
        found.append((rows + start, target_columns[columns], distance[rows, columns]))
    if not found:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return tuple(np.concatenate(parts) for parts in zip(*found))  # type: ignore[return-value]


def closest_matches(
    hashes: np.ndarray, targets: np.ndarray, max_distance: int
) -> dict[int, tuple[int, int]]:
    """index into hashes -> (index into targets, distance) of its closest target within
    max_distance bits (the lower index on a tie); only hashes that match something."""
    rows, columns, distances = hamming_matches(hashes, targets, max_distance)
    closest: dict[int, tuple[int, int]] = {}
    for row, column, distance in zip(rows.tolist(), columns.tolist(), distances.tolist()):
        if row not in closest or distance < closest[row][1]:
            closest[row] = (column, distance)
    return closest


@dataclass
class TestHashes:
    """The hashes of every test image: what the training data is compared with."""

    __test__ = False

    image_ids: list[int]
    phashes: np.ndarray  # uint64
    pixel_hashes: list[str]
    sha256: dict[str, str]  # the test set's files, as the manifest records them

    @classmethod
    def of(cls, items, max_pixels: int, sha256: dict[str, str]) -> TestHashes:
        """From (image_id, image bytes) items; an image that does not decode is left out (the
        test set's own check reports it)."""
        ids, phashes, pixels = [], [], []
        for image_id, raw in items:
            image = open_image(raw, max_pixels)
            if image is None:
                continue
            ids.append(image_id)
            phashes.append(image_hash(raw, max_pixels))  # as the training images are hashed
            pixels.append(pixel_hash(image))
        return cls(ids, np.array(phashes, dtype=np.uint64), pixels, sha256)


@dataclass
class Findings:
    """Training samples found in the test set, for the manifest."""

    mode: str
    max_distance: int
    test_images: int
    test_sha256: dict[str, str]
    checked: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"exact": 0, "near": 0})
    test_images_found: set[int] = field(default_factory=set)
    examples: list[dict] = field(default_factory=list)

    def add(self, sample: str, split: str, test_image_id: int, distance: int, kind: str) -> None:
        self.counts[kind] += 1
        self.test_images_found.add(test_image_id)
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(
                {
                    "sample": sample,
                    "split": split,
                    "test_image_id": test_image_id,
                    "distance": distance,
                    "kind": kind,
                }
            )

    def to_dict(self) -> dict:
        found = self.counts["exact"] + self.counts["near"]
        return {
            "checked": True,
            "mode": self.mode,
            "method": f"pHash 64-bit, <= {self.max_distance} bits; exact: decoded-pixel sha256",
            "test_set_sha256": self.test_sha256,
            "test_images": self.test_images,
            "samples_checked": self.checked,
            "found": {**self.counts, "total": found},
            "test_images_found": len(self.test_images_found),
            "dropped": found if self.mode == "drop" else 0,
            "examples": self.examples,
        }


def not_checked(reason: str) -> dict:
    return {"checked": False, "reason": reason}


def combined(records: dict[str, dict]) -> dict:
    """One record for several sources' (by name), checked against one test set: checked when
    every one was, with their counts summed (a test image found in two sources counts twice in
    `test_images_found`) and each source's own record under `sources`."""
    unchecked = [(name, r) for name, r in records.items() if not r.get("checked")]
    if unchecked:
        name, record = unchecked[0]
        return {**not_checked(f"source {name}: {record.get('reason')}"), "sources": records}
    first = next(iter(records.values()))
    found = {
        kind: sum(r["found"][kind] for r in records.values()) for kind in ("exact", "near", "total")
    }
    return {
        **{key: first[key] for key in ("checked", "mode", "method", "test_set_sha256")},
        "test_images": first["test_images"],
        "samples_checked": sum(r["samples_checked"] for r in records.values()),
        "found": found,
        "test_images_found": sum(r["test_images_found"] for r in records.values()),
        "dropped": sum(r["dropped"] for r in records.values()),
        "sources": records,
    }


def eval_record(data_manifest: Path, test_dir: Path) -> dict:
    """For eval.info.json: was the training data of data_manifest checked against the test set in
    test_dir (the same files, by sha256), and with what result."""
    if not Path(data_manifest).is_file():
        return not_checked(f"no data manifest at {data_manifest}")
    manifest = json.loads(Path(data_manifest).read_text(encoding="utf-8"))
    record = manifest.get("decontamination") or not_checked("the data stage did not check")
    if not record.get("checked"):
        return record
    current = {
        name: sha256_file(Path(test_dir) / name)
        for name in (testset.IMAGES_FILE, testset.TEXTS_FILE)
    }
    same = record.get("test_set_sha256") == current
    return {
        "checked": same,
        "against_this_test_set": same,
        **(
            {k: record[k] for k in ("mode", "method", "found", "dropped", "test_images_found")}
            if same
            else {"reason": "the training data was checked against another test set"}
        ),
    }
