"""Which (shard, sample) sits at each position of each epoch, as a function of the seed alone.

So a resumed run reads exactly the samples the interrupted one would have.

Epoch e visits every training sample once. The shards are shuffled by (seed, e) and cut into
windows of `window_shards` consecutive shards; the samples of each window are shuffled together
by (seed, e, window). A 4096-pair batch thus mixes samples of up to that many shards (its
negatives are not a run of neighbouring metadata rows), while the loader reads from a bounded
set of open files (EpochOrder).

A mixture of sources (data.source: mixture) keeps this: each position's source is dealt by the
sources' weights in shuffled blocks, and its sample is the next of that source's own EpochOrder
(MixtureOrder).
"""

from __future__ import annotations

import bisect
import math
from functools import lru_cache

import numpy as np


class EpochOrder:
    """Which (shard, sample) sits at each position of each epoch."""

    def __init__(self, counts: list[int], seed: int, window_shards: int):
        self.counts = counts
        self.seed = seed
        self.window_shards = window_shards
        self.num_samples = sum(counts)

    # Per-instance caches by design: one EpochOrder lives as long as its loader.
    @lru_cache(maxsize=4)  # noqa: B019
    def _windows(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.counts))
        windows = [
            order[i : i + self.window_shards] for i in range(0, len(order), self.window_shards)
        ]
        ends = np.cumsum([sum(self.counts[s] for s in w) for w in windows])
        return windows, ends

    @lru_cache(maxsize=8)  # noqa: B019
    def _window_order(self, epoch: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        shards = self._windows(epoch)[0][window]
        shard_of = np.concatenate([np.full(self.counts[s], s) for s in shards])
        index_in = np.concatenate([np.arange(self.counts[s]) for s in shards])
        mix = np.random.default_rng([self.seed, epoch, window, 1]).permutation(len(shard_of))
        return shard_of[mix], index_in[mix]

    def locate(self, epoch: int, position: int) -> tuple[int, int]:
        _, ends = self._windows(epoch)
        k = bisect.bisect_right(ends, position)
        start = int(ends[k - 1]) if k else 0
        shard_of, index_in = self._window_order(epoch, k)
        return int(shard_of[position - start]), int(index_in[position - start])


# A mixture is dealt out in blocks of this many positions, each holding every source's share
# (rounded to whole places) in a shuffled order: the counts match the weights exactly over every
# block, and a batch's mix varies as a draw without replacement would.
MIXTURE_BLOCK = 2**14


def block_counts(weights: list[float], block: int) -> list[int]:
    """Each source's places in a block of `block`: its share of it, rounded by largest remainder
    (the roundings' sum is exactly the block)."""
    total = sum(weights)
    exact = [block * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda k: (counts[k] - exact[k], k))
    for k in by_remainder[: block - sum(counts)]:
        counts[k] += 1
    return counts


class MixtureOrder:
    """EpochOrder for a weighted mixture of sources: which (shard, sample) sits at each position.

    The positions of all epochs, one after the other, are cut into blocks of MIXTURE_BLOCK; a
    block holds each source's block_counts places, shuffled by (seed, block). The n-th place of
    source k overall (its earlier blocks' places, then its rank in this block) is position n of
    source k's own EpochOrder continued over its epochs: every sample of a source once per pass
    over it, a small source up-weighted repeating sooner. Everything is a function of (seed,
    epoch, position), as EpochOrder's: a resumed run reads the same samples. An epoch is as many
    positions as the sources have samples together."""

    def __init__(
        self, counts: list[list[int]], weights: list[float], seed: int, window_shards: int
    ):
        if any(sum(c) == 0 for c in counts):
            raise ValueError("every source of a mixture needs samples")  # the data stage refuses
        self.seed = seed
        self.sizes = [sum(c) for c in counts]
        self.num_samples = sum(self.sizes)
        self.per_block = block_counts(weights, MIXTURE_BLOCK)
        self.first_shards = np.cumsum([0] + [len(c) for c in counts]).tolist()
        self.orders = [
            EpochOrder(c, _source_seed(seed, k), window_shards) for k, c in enumerate(counts)
        ]

    # Per-instance caches by design: one MixtureOrder lives as long as its loader.
    @lru_cache(maxsize=4)  # noqa: B019
    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, rank among that source's places) of each place of the block."""
        labels = np.repeat(np.arange(len(self.per_block)), self.per_block)
        labels = np.random.default_rng([self.seed, block, 4]).permutation(labels)
        ranks = np.empty(len(labels), dtype=np.int64)
        for k, count in enumerate(self.per_block):
            ranks[labels == k] = np.arange(count)
        return labels, ranks

    def source_of(self, epoch: int, position: int) -> tuple[int, int]:
        """(source, its place number n over all epochs) at a position."""
        block, offset = divmod(epoch * self.num_samples + position, MIXTURE_BLOCK)
        labels, ranks = self._block(block)
        source = int(labels[offset])
        return source, block * self.per_block[source] + int(ranks[offset])

    def locate(self, epoch: int, position: int) -> tuple[int, int]:
        source, place = self.source_of(epoch, position)
        source_epoch, source_position = divmod(place, self.sizes[source])
        shard, index = self.orders[source].locate(source_epoch, source_position)
        return self.first_shards[source] + shard, index


def _source_seed(seed: int, source: int) -> int:
    """Source k's own order's seed: independent of the others' and of the block shuffles."""
    return int(np.random.default_rng([seed, source, 3]).integers(2**62))


def sample_seed(seed: int, epoch: int, position: int) -> int:
    return int(np.random.default_rng([seed, epoch, position, 2]).integers(2**62))
