"""Training data as a pure function of the step: what makes resume exact and cheap.

Epoch e visits every training sample once: the shards in an order shuffled by (seed, e), the
samples of each shard in an order shuffled by (seed, e, shard). Optimizer step s of the epoch
uses positions [s*G, (s+1)*G) of that sequence (G = global batch); rank r's micro-batch j of
the step takes the slice starting at s*G + (j*W + r)*m (W ranks, micro batch m). Random
augmentation is seeded per sample from (seed, epoch, position).

So micro-batch number i of a rank is computable from i alone: a resumed run starts its
DataLoader at the checkpoint's position and sees exactly the batches the interrupted run would
have seen, whatever the number of loader workers, without reading the skipped samples.
"""

from __future__ import annotations

import bisect
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from clipforge.config import BatchPlan, steps_per_epoch
from clipforge.data.shards import ShardReader


@dataclass(frozen=True)
class SplitFiles:
    paths: list[Path]
    counts: list[int]

    @property
    def num_samples(self) -> int:
        return sum(self.counts)


def split_files(data_dir: Path, split: str) -> SplitFiles:
    """Shards of a split and their sample counts, from data/manifest.json."""
    manifest = json.loads((data_dir / "manifest.json").read_text(encoding="utf-8"))
    shards = manifest["splits"][split]["shards"]
    return SplitFiles([data_dir / s["name"] for s in shards], [int(s["count"]) for s in shards])


class EpochOrder:
    """Which (shard, sample) sits at each position of each epoch."""

    def __init__(self, counts: list[int], seed: int):
        self.counts = counts
        self.seed = seed
        self.num_samples = sum(counts)

    # Per-instance caches by design: one EpochOrder lives as long as its loader.
    @lru_cache(maxsize=4)  # noqa: B019
    def _shard_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.counts))
        ends = np.cumsum([self.counts[i] for i in order])
        return order, ends

    @lru_cache(maxsize=64)  # noqa: B019
    def _sample_order(self, epoch: int, shard: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch, shard, 1]).permutation(self.counts[shard])

    def locate(self, epoch: int, position: int) -> tuple[int, int]:
        order, ends = self._shard_order(epoch)
        k = bisect.bisect_right(ends, position)
        start = int(ends[k - 1]) if k else 0
        shard = int(order[k])
        return shard, int(self._sample_order(epoch, shard)[position - start])


def sample_seed(seed: int, epoch: int, position: int) -> int:
    return int(np.random.default_rng([seed, epoch, position, 2]).integers(2**62))


class MicroBatches(torch.utils.data.Dataset):
    """Item i = this rank's i-th micro-batch of the run: (images, token ids)."""

    def __init__(
        self,
        files: SplitFiles,
        plan: BatchPlan,
        rank: int,
        seed: int,
        total_steps: int,
        transform: Callable,
        tokenizer: Callable,
    ):
        self.files = files
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.total_steps = total_steps
        self.transform = transform
        self.tokenizer = tokenizer
        self.order = EpochOrder(files.counts, seed)
        self.steps_per_epoch = steps_per_epoch(files.num_samples, plan.global_batch_size)
        self._reader: ShardReader | None = None  # opened lazily, once per loader worker

    def __len__(self) -> int:
        return self.total_steps * self.plan.grad_accum_steps

    def positions(self, index: int) -> tuple[int, range]:
        """(epoch, positions in the epoch) of micro-batch `index` of this rank."""
        step, j = divmod(index, self.plan.grad_accum_steps)
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        m, world = self.plan.micro_batch_size, self.plan.world_size
        start = step_in_epoch * self.plan.global_batch_size + (j * world + self.rank) * m
        return epoch, range(start, start + m)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._reader is None:
            self._reader = ShardReader(self.files.paths)
        epoch, positions = self.positions(index)
        images, captions = [], []
        for position in positions:
            sample = self._reader.read(*self.order.locate(epoch, position))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(sample_seed(self.seed, epoch, position))
                images.append(self.transform(Image.open(io.BytesIO(sample["jpg"]))))
            captions.append(sample["txt"].decode("utf-8"))
        return torch.stack(images), self.tokenizer(captions)


def micro_batch_loader(
    dataset: MicroBatches, start: int, num_workers: int, pin_memory: bool
) -> torch.utils.data.DataLoader:
    """Batches dataset[start], dataset[start + 1], ... in order, prepared by worker processes."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        sampler=range(start, len(dataset)),
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=4 if num_workers else None,
        persistent_workers=False,
    )
