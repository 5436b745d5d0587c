"""The data order is a pure function of the step: every sample once per epoch, exact resume."""

from __future__ import annotations

from clipforge.config import BatchPlan
from clipforge.train.data import EpochOrder, MicroBatches, SplitFiles


def test_each_epoch_visits_every_sample_exactly_once_in_a_new_order():
    order = EpochOrder([5, 3, 7], seed=0)
    epochs = [[order.locate(e, p) for p in range(15)] for e in range(2)]
    for visited in epochs:
        assert sorted(visited) == sorted((s, i) for s, n in enumerate([5, 3, 7]) for i in range(n))
    assert epochs[0] != epochs[1]


def _dataset(plan: BatchPlan, rank: int) -> MicroBatches:
    files = SplitFiles(paths=[], counts=[40, 24])
    return MicroBatches(files, plan, rank, seed=1, total_steps=4, transform=None, tokenizer=None)


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
