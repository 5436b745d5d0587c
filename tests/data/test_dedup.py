"""De-duplication in bounded memory: string hashes and the numpy hash set behave like a Python
set of the strings, batch after batch, first occurrence first."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from clipforge.data.dedup import HashSet64, first_occurrences, hash_strings


def test_equal_strings_hash_equal_and_different_ones_differ():
    """Same string, same hash, whatever the array around it (slices, large_string); distinct
    strings (empty, one byte apart, swapped bytes, long ones) get distinct hashes."""
    words = [
        "",
        "a",
        "b",
        "ab",
        "ba",
        "图片",
        "图片 ",
        "x" * 5000,
        "x" * 4999 + "y",
        "y" + "x" * 4999,
    ]
    hashes = hash_strings(pa.array(words))
    assert len(set(hashes.tolist())) == len(words) and (hashes != 0).all()
    sliced = pa.array(["zz", *words])[1:]
    assert (hash_strings(sliced) == hashes).all()
    assert (hash_strings(pa.array(words, type=pa.large_string())) == hashes).all()


def test_the_set_keeps_first_occurrences_like_a_python_set():
    """Over batches with repeats inside and across them, the rows kept are exactly those a Python
    set of the strings would keep, in order."""
    rng = np.random.default_rng(0)
    seen, kept_expected, kept = set(), [], []
    table = HashSet64(20_000)
    for batch in range(10):
        strings = [f"https://example.com/{n}" for n in rng.integers(0, 3000, 2000)]
        for index, text in enumerate(strings):
            if text not in seen:
                seen.add(text)
                kept_expected.append((batch, index))
        found = first_occurrences(hash_strings(pa.array(strings)), table)
        kept += [(batch, int(index)) for index in found]
    assert kept == kept_expected
    assert table.size == len(seen)


def test_memory_is_fixed_by_the_rows_it_may_hold():
    """A set for 1M rows is one array of about 9.4 MB: 100M rows fit in 0.94 GB."""
    table = HashSet64(1_000_000)
    assert table.nbytes < 9.5e6
    table.add_new(np.arange(1, 850_001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    assert table.nbytes < 9.5e6 and table.size == 850_000
