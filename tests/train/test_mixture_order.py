"""A weighted mixture's data order (MixtureOrder): each source's share of the positions matches its
weight (exactly over a block, within sampling error over any stretch), each source's samples are
visited once per pass over it, and the batches are a function of their number alone, so a resumed
run reads exactly what an uninterrupted one does."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torchvision import transforms

from clipforge.data import testset
from clipforge.data.stage import main
from clipforge.train.config import BatchPlan
from clipforge.train.loader import (
    MicroBatches,
    micro_batch_loader,
    split_files,
)
from clipforge.train.order import MIXTURE_BLOCK, EpochOrder, MixtureOrder, block_counts
from tests.support.shards import textured_jpeg, write_tar

SIGMAS = 4  # a count more than 4 binomial standard deviations off fails once in ~16,000 tries
COUNTS = [[50, 30], [7], [20, 20, 5]]  # samples per shard, per source
WEIGHTS = [3.0, 1.0, 0.5]


def _shares() -> list[float]:
    return [w / sum(WEIGHTS) for w in WEIGHTS]


def _within_sampling_error(counts: list[int], shares: list[float]) -> None:
    n = sum(counts)
    for count, share in zip(counts, shares, strict=True):
        sigma = math.sqrt(n * share * (1 - share))
        assert abs(count - n * share) <= SIGMAS * sigma, (count, n * share, sigma)


def test_each_block_holds_every_source_exactly_its_share_rounded():
    order = MixtureOrder(COUNTS, WEIGHTS, seed=0, window_shards=2)
    expected = block_counts(WEIGHTS, MIXTURE_BLOCK)
    assert sum(expected) == MIXTURE_BLOCK
    assert all(abs(c - MIXTURE_BLOCK * s) < 1 for c, s in zip(expected, _shares()))
    per_epoch = order.num_samples
    for block in (0, 3):
        start = block * MIXTURE_BLOCK
        epoch, position = divmod(start, per_epoch)
        sources = [order.source_of(*divmod(start + p, per_epoch))[0] for p in range(MIXTURE_BLOCK)]
        assert np.bincount(sources, minlength=3).tolist() == expected, (epoch, position)


@pytest.mark.parametrize("start", [0, 9000, 5 * MIXTURE_BLOCK - 700])
def test_the_sources_of_any_stretch_of_positions_match_the_weights_within_sampling_error(start):
    """2000 positions from anywhere (across a block's end too): each source's count within
    SIGMAS binomial standard deviations of its share (a draw without replacement from a block
    varies less than the binomial)."""
    order = MixtureOrder(COUNTS, WEIGHTS, seed=1, window_shards=2)
    sources = [order.source_of(0, start + p)[0] for p in range(2000)]
    _within_sampling_error(np.bincount(sources, minlength=3).tolist(), _shares())


def test_each_source_visits_its_samples_once_per_pass_over_it():
    """Source 1 has 7 samples and a sixth of the places: its places 0..6 are its 7 samples, 7..13
    again, in another order; the large source moves on through its own epoch meanwhile."""
    order = MixtureOrder(COUNTS, WEIGHTS, seed=2, window_shards=2)
    by_place: dict[int, dict[int, tuple[int, int]]] = {0: {}, 1: {}, 2: {}}
    for position in range(400):
        source, place = order.source_of(0, position)
        by_place[source][place] = order.locate(0, position)
    small = by_place[1]
    first, second = [small[n] for n in range(7)], [small[n] for n in range(7, 14)]
    assert sorted(first) == sorted(second) == [(2, i) for i in range(7)]  # shard 2: source 1's
    assert first != second
    big = [by_place[0][n] for n in range(80)]
    assert sorted(big) == [(s, i) for s, n in enumerate([50, 30]) for i in range(n)]


def test_a_sources_places_are_numbered_on_across_blocks_and_epochs():
    """Over two blocks (and the epochs in them), each source's places are 0, 1, 2, ... each once:
    no sample of a later block repeats an earlier block's place."""
    order = MixtureOrder(COUNTS, WEIGHTS, seed=3, window_shards=2)
    places: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for p in range(2 * MIXTURE_BLOCK):
        source, place = order.source_of(*divmod(p, order.num_samples))
        places[source].append(place)
    assert all(sorted(found) == list(range(len(found))) for found in places.values())


def test_the_order_is_a_function_of_seed_epoch_and_position():
    """A fresh order (a resumed run's) gives the same samples at the same positions, in any
    order of asking; another seed another order."""
    asked = [(e, p) for e in range(3) for p in range(0, 164, 7)]
    first = MixtureOrder(COUNTS, WEIGHTS, seed=5, window_shards=2)
    answers = [first.locate(e, p) for e, p in asked]
    fresh = MixtureOrder(COUNTS, WEIGHTS, seed=5, window_shards=2)
    assert [fresh.locate(e, p) for e, p in reversed(asked)] == answers[::-1]
    other = MixtureOrder(COUNTS, WEIGHTS, seed=6, window_shards=2)
    assert [other.locate(e, p) for e, p in asked] != answers


def _source_shard(path: Path, prefix: str, count: int, seed: int) -> None:
    members = []
    for n in range(count):
        key = f"{prefix}-{n:03d}"
        members += [(f"{key}.jpg", textured_jpeg(seed + n, size=(32, 24))), (f"{key}.txt", key)]
    write_tar(path, [(name, m if isinstance(m, bytes) else m.encode()) for name, m in members])


@pytest.fixture(scope="module")
def mixture_data(tmp_path_factory) -> Path:
    """The data stage's mixture: `big` (60 pairs, weight 1) and `small` (10 pairs, weight 3)."""
    root = tmp_path_factory.mktemp("mixture")
    (root / "big").mkdir()
    (root / "small").mkdir()
    _source_shard(root / "big" / "a.tar", "big", 60, 0)
    _source_shard(root / "small" / "a.tar", "small", 10, 500)
    tests = [(i, textured_jpeg(900 + i), [f"测试 {i}"]) for i in range(4)]
    testset.write_test_set(root / "test", tests)
    mixture = [
        {"name": "big", "source": "webdataset", "paths": [str(root / "big/a.tar")], "weight": 1},
        {"name": "small", "source": "webdataset", "paths": [str(root / "small/a.tar")]}
        | {"weight": 3},
    ]
    data = {
        "source": "mixture",
        "mixture": mixture,
        "test_dir": str(root / "test"),
        "val_fraction": 0.0,
        "in_place": False,
        "samples_per_shard": 16,
    }
    (root / "params.yaml").write_text(yaml.safe_dump({"data": data}), encoding="utf-8")
    assert main(["--params", str(root / "params.yaml"), "--out", str(root / "data")]) == 0
    return root / "data"


def _tokens(captions: list[str]) -> torch.Tensor:
    """A caption's bytes as its ids: a batch says which samples it holds."""
    return torch.tensor([list(c.encode().ljust(16, b"\0")) for c in captions])


def _batches(data: Path, plan: BatchPlan, rank: int, steps: int, start: int) -> list:
    files = split_files(data, "train")
    transform = transforms.Compose([transforms.Resize((8, 8)), transforms.PILToTensor()])
    dataset = MicroBatches(files, plan, rank, 7, steps, transform, _tokens, 2)
    loader = micro_batch_loader(dataset, start, 0, False, 2)
    return [
        (torch.cat([c[0] for c in group]), torch.cat([c[1] for c in group])) for group in loader
    ]


def _captions(tokens: torch.Tensor) -> list[str]:
    return [bytes(row.tolist()).rstrip(b"\0").decode() for row in tokens]


def test_the_loaders_batches_hold_each_source_by_its_weight(mixture_data):
    """Over 60 steps of 16 (13.7 epochs of the 70 pairs), `small` (a quarter of the data, three
    quarters of the weight) fills three quarters of the places within sampling error."""
    plan = BatchPlan(16, 8, 2, 1)
    captions = [
        c for _, tokens in _batches(mixture_data, plan, 0, 60, 0) for c in _captions(tokens)
    ]
    assert len(captions) == 960
    small = sum(c.startswith("small-") for c in captions)
    _within_sampling_error([small, len(captions) - small], [0.75, 0.25])
    assert {c for c in captions if c.startswith("small-")} == {f"small-{n:03d}" for n in range(10)}


def test_a_resumed_run_reads_exactly_the_batches_of_an_uninterrupted_one(mixture_data):
    """Every rank's micro-batches from step 5 on are the same, pixels and ids, whether the loader
    started at step 0 or at step 5 (a fresh loader, as a resumed run builds)."""
    plan = BatchPlan(16, 4, 2, 2)
    steps, resume_at = 12, 5
    for rank in range(plan.world_size):
        whole = _batches(mixture_data, plan, rank, steps, 0)
        resumed = _batches(mixture_data, plan, rank, steps, resume_at * plan.grad_accum_steps)
        assert len(resumed) == (steps - resume_at) * plan.grad_accum_steps
        for (images, tokens), (images_again, tokens_again) in zip(
            whole[resume_at * plan.grad_accum_steps :], resumed, strict=True
        ):
            assert torch.equal(images, images_again) and torch.equal(tokens, tokens_again)


def test_a_single_source_keeps_its_epoch_order(small_data):
    """data/ of one source has no mixture: the loader's order is EpochOrder, as before mixtures."""
    files = split_files(small_data, "train")
    assert not files.parts and not files.weights
    order = files.order(3, 4)
    assert type(order) is EpochOrder
    plain = EpochOrder(files.counts, 3, 4)
    assert [order.locate(1, p) for p in range(50)] == [plain.locate(1, p) for p in range(50)]
