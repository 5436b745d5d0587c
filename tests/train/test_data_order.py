"""The data order is a pure function of the step: every sample once per epoch, exact resume;
batches mix many shards; the loader's chunks and its shared-memory budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from clipforge.train.config import BatchPlan
from clipforge.train.loader import (
    CHUNK_SAMPLES,
    DeviceBatches,
    MicroBatches,
    SplitFiles,
    chunk_bounds,
    prefetch_factor,
    uint8_transform,
)
from clipforge.train.order import EpochOrder


@pytest.mark.parametrize("window_shards", [1, 2, 64])
def test_each_epoch_visits_every_sample_exactly_once_in_a_new_order(window_shards):
    order = EpochOrder([5, 3, 7], seed=0, window_shards=window_shards)
    epochs = [[order.locate(e, p) for p in range(15)] for e in range(2)]
    for visited in epochs:
        assert sorted(visited) == sorted((s, i) for s, n in enumerate([5, 3, 7]) for i in range(n))
    assert epochs[0] != epochs[1]


def test_a_batch_mixes_samples_of_many_shards():
    """100 shards of 1000 consecutive rows: a 1024-sample batch of a 64-shard window draws from
    dozens of shards, where a within-shard shuffle gives one or two."""
    order = EpochOrder([1000] * 100, seed=0, window_shards=64)
    shards = {order.locate(0, p)[0] for p in range(1024)}
    assert len(shards) > 50
    within_one_shard = EpochOrder([1000] * 100, seed=0, window_shards=1)
    assert len({within_one_shard.locate(0, p)[0] for p in range(1024)}) <= 2


def _dataset(plan: BatchPlan, rank: int) -> MicroBatches:
    files = SplitFiles(paths=[], counts=[40, 24])
    return MicroBatches(files, plan, rank, 1, 4, transform=None, tokenizer=None, window_shards=2)


def test_micro_batches_of_all_ranks_tile_the_global_batch():
    """Over the accumulation steps of all ranks, a step covers positions [s*G, (s+1)*G) once."""
    plan = BatchPlan(global_batch_size=16, micro_batch_size=4, grad_accum_steps=2, world_size=2)
    covered = []
    for rank in range(2):
        dataset = _dataset(plan, rank)
        for j in range(2):  # step 1 of epoch 0: micro-batch indices 2 and 3
            epoch, positions = dataset.positions(1 * 2 + j)
            assert epoch == 0
            covered += list(positions)
    assert sorted(covered) == list(range(16, 32))


def test_positions_wrap_into_the_next_epoch_dropping_the_remainder():
    plan = BatchPlan(global_batch_size=16, micro_batch_size=16, grad_accum_steps=1, world_size=1)
    dataset = _dataset(plan, 0)
    assert dataset.steps_per_epoch == 4  # 64 samples // 16
    assert dataset.positions(4) == (1, range(0, 16))


@pytest.mark.parametrize("micro", [1, 63, 64, 65, 1000, 1024])
def test_chunks_tile_a_micro_batch_and_none_exceeds_the_chunk_size(micro):
    bounds = chunk_bounds(micro)
    assert bounds[0][0] == 0 and bounds[-1][1] == micro
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(0 < stop - start <= CHUNK_SAMPLES for start, stop in bounds)


def test_device_normalisation_equals_open_clips_preprocessing():
    """uint8 from the workers, normalised later: the same floats as ToTensor + Normalize."""
    import open_clip

    preprocess = open_clip.create_model_and_transforms("ViT-B-32")[2]
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 260, 3), np.uint8))
    transform, mean, std = uint8_transform(preprocess)
    pixels = transform(image)
    assert pixels.dtype == torch.uint8
    to_device = DeviceBatches(mean, std, torch.device("cpu"), torch.float32)
    images, texts = to_device([(pixels[None], torch.zeros(1, 3, dtype=torch.long))] * 2)
    assert images.shape == (2, 3, 224, 224) and texts.shape == (2, 3)
    assert torch.equal(images[1], preprocess(image))


def test_prefetch_fits_the_shared_memory_share_or_the_error_names_the_remedy():
    mib = 2**20
    assert prefetch_factor(10 * mib, 8, 4, free_bytes=64 * 1024 * mib) == 4  # plenty: the maximum
    assert prefetch_factor(10 * mib, 8, 4, free_bytes=700 * mib) == 1  # 350 MiB usable: one each
    assert prefetch_factor(10 * mib, 0, 4, free_bytes=0) == 4  # no workers: no shared memory
    with pytest.raises(ValueError, match="lower train.num_workers or enlarge /dev/shm"):
        prefetch_factor(10 * mib, 8, 4, free_bytes=64 * mib)  # Docker's default /dev/shm
