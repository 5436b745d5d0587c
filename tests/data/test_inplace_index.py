"""The in-place index (data/<split>/NNNNNN.npz): whatever the shard's layout, the locations read
back are exactly those written; a regular shard's index costs a few bytes per pair."""

from __future__ import annotations

import io

import numpy as np
import pytest

from clipforge.data.shards import decode_index, encode_index


def _layout(rng, count: int, caption_first: bool = False) -> np.ndarray:
    """Locations of `count` samples written one after another (<key>.jpg, <key>.txt)."""
    rows, position = [], 0
    for image, caption in zip(rng.integers(8_000, 40_000, count), rng.integers(5, 300, count)):
        padded = [(int(image) + 511) // 512 * 512, (int(caption) + 511) // 512 * 512]
        image_at = position + 512 + (512 + padded[1] if caption_first else 0)
        caption_at = position + 512 if caption_first else image_at + padded[0] + 512
        rows.append((image_at, int(image), caption_at, int(caption)))
        position += 1024 + sum(padded)
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def _stored(locations: np.ndarray) -> tuple[np.ndarray, int]:
    """(the locations as read back from the saved file, the file's size)."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **encode_index(locations))
    size = buffer.tell()
    buffer.seek(0)
    with np.load(buffer) as stored:
        return decode_index(stored), size


@pytest.mark.parametrize(
    "case",
    ["regular", "a split's share", "caption first", "empty", "one", "reversed", "beyond 4 GiB"],
)
def test_locations_come_back_exactly(case):
    """Regular shards, a split's scattered rows, other member orders, past 32-bit offsets."""
    rng = np.random.default_rng(7)
    locations = _layout(rng, 2000, caption_first=case == "caption first")
    locations = {
        "a split's share": locations[rng.random(len(locations)) < 0.1],
        "empty": locations[:0],
        "one": locations[:1],
        "reversed": locations[::-1],
        "beyond 4 GiB": locations + np.array([5 * 2**32, 0, 5 * 2**32, 0]),
    }.get(case, locations)
    read, _ = _stored(locations)
    assert read.dtype == np.int64 and read.shape == locations.shape
    assert (read == locations).all()


def test_a_regular_shard_costs_under_four_bytes_per_pair():
    """Offsets cost nothing where the layout predicts them; the sizes are what is stored."""
    locations = _layout(np.random.default_rng(0), 10_000)
    kept = locations[np.random.default_rng(1).random(len(locations)) < 0.99]  # the train share
    _, size = _stored(kept)
    assert size / len(kept) < 4
