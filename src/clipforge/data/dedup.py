"""De-duplication in bounded memory: 64-bit string hashes in a numpy hash table.

The LAION filter keeps the first row of each URL and of each caption over 100M+ rows. Python
sets of hashes cost ~100 bytes per kept row (10 GB at 100M); here a set is one preallocated
uint64 array of BYTES_PER_ROW / 8 slots per row that can reach it (the rows read, known from the
parquet footers before filtering), so a set of 100M rows is 0.94 GB, and no hash is ever
a Python object:
- strings are hashed a batch at a time by simple tabulation hashing over their UTF-8 bytes (a
  random 64-bit word per (byte position, byte value), XORed per string: 3-independent, so two
  different strings collide with probability 2^-64; at 100M rows a spurious duplicate is
  expected once in ~10^3 such runs), then mixed with the length;
- the table is open addressing with linear probing, filled at most to MAX_LOAD; a batch of
  keys is inserted in vectorised rounds (each round, every pending key looks at its slot).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

MAX_LOAD = 0.85
BYTES_PER_ROW = 8 / MAX_LOAD  # one set's memory per row it may hold: ~9.4 bytes
_TABLE_POSITIONS = 4096  # positions with their own random words; longer strings wrap around
_EMPTY = np.uint64(0)


@lru_cache(maxsize=1)
def _tabulation() -> np.ndarray:
    """Fixed random words (seeded: the same string hashes the same in every run)."""
    return np.random.default_rng(0x5EED).integers(
        0, 2**64, size=(_TABLE_POSITIONS, 256), dtype=np.uint64, endpoint=False
    )


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def hash_strings(strings) -> np.ndarray:
    """uint64 hash of each string of a pyarrow string array without nulls (never 0: the empty
    slot)."""
    import pyarrow as pa

    if pa.types.is_string(strings.type):
        offsets_type = np.int32
    elif pa.types.is_large_string(strings.type):
        offsets_type = np.int64
    else:
        raise TypeError(f"not a string array: {strings.type}")
    n = len(strings)
    _, offsets_buffer, data_buffer = strings.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=offsets_type)[
        strings.offset : strings.offset + n + 1
    ].astype(np.int64)
    lengths = np.diff(offsets)
    data = (
        np.frombuffer(data_buffer, dtype=np.uint8)[offsets[0] : offsets[-1]]
        if data_buffer is not None
        else np.zeros(0, dtype=np.uint8)
    )
    starts = offsets[:-1] - offsets[0]
    positions = np.arange(len(data), dtype=np.int64) - np.repeat(starts, lengths)
    words = _tabulation()[positions % _TABLE_POSITIONS, data]
    hashes = np.zeros(n, dtype=np.uint64)
    nonempty = lengths > 0
    if nonempty.any():
        hashes[nonempty] = np.bitwise_xor.reduceat(words, starts[nonempty])
    hashes = _mix(hashes ^ _mix(lengths.astype(np.uint64)))
    hashes[hashes == _EMPTY] = 1
    return hashes


class HashSet64:
    """A set of non-zero uint64 keys in one preallocated array."""

    def __init__(self, max_keys: int):
        self.capacity = max(16, int(max_keys / MAX_LOAD) + 1)
        self.slots = np.zeros(self.capacity, dtype=np.uint64)
        self.size = 0

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    def add_new(self, keys: np.ndarray) -> np.ndarray:
        """Insert distinct keys; True where a key was not in the set before."""
        keys = np.asarray(keys, dtype=np.uint64)
        new = np.zeros(len(keys), dtype=bool)
        pending = np.arange(len(keys))
        slot = (keys % np.uint64(self.capacity)).astype(np.int64)
        while pending.size:
            wanted = slot[pending]
            current = self.slots[wanted]
            empty = current == _EMPTY
            # of the keys wanting one empty slot, the first takes it (the others move on: the
            # slot now holds another key, as keys are distinct)
            claimants = pending[empty]
            _, first = np.unique(wanted[empty], return_index=True)
            winners = claimants[first]
            self.slots[slot[winners]] = keys[winners]
            new[winners] = True
            done = current == keys[pending]
            done[np.flatnonzero(empty)[first]] = True
            pending = pending[~done]
            slot[pending] = (slot[pending] + 1) % self.capacity
        self.size += int(new.sum())
        if self.size > self.capacity * MAX_LOAD:
            raise RuntimeError(f"HashSet64 holds {self.size} keys, sized for fewer")
        return new


def first_occurrences(hashes: np.ndarray, seen: HashSet64) -> np.ndarray:
    """Indices of the rows whose hash neither an earlier row of this batch nor the set has,
    in row order; those hashes join the set."""
    if not len(hashes):
        return np.zeros(0, dtype=np.int64)
    unique, first = np.unique(hashes, return_index=True)
    new = seen.add_new(unique)
    return np.sort(first[new])
