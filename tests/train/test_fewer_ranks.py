"""The pure parts of going on with fewer ranks: the batch kept, the ranks the supervisor says,
the data-parallel size a checkpoint was saved at and its optimizer's shards (the end-to-end run:
tests/launcher/host/test_fewer_gpus.py)."""

from __future__ import annotations

import pytest

from clipforge.checkpoints.layout import (
    data_parallel_size,
    optimizer_shards,
    written_by_bf16_optimizer,
)
from clipforge.fields import ConfigError
from clipforge.train.config import BatchPlan, reshaped_plan
from clipforge.util import RANKS_NOW_ENV, ranks_per_node_now


def test_fewer_ranks_keep_the_global_and_micro_batch_and_accumulate_more():
    planned = BatchPlan(
        global_batch_size=256, micro_batch_size=16, grad_accum_steps=2, world_size=8
    )
    assert reshaped_plan(planned, 4) == BatchPlan(256, 16, 4, 4)
    assert reshaped_plan(planned, 1) == BatchPlan(256, 16, 16, 1)
    assert reshaped_plan(BatchPlan(256, 16, 4, 4), 8) == planned  # the GPUs are back
    with pytest.raises(ConfigError, match="micro batch 16 x 3 ranks left = 48"):
        reshaped_plan(planned, 3)


def test_the_ranks_now_are_the_planned_ones_unless_the_supervisor_says_fewer():
    assert ranks_per_node_now(4, {}) == 4
    assert ranks_per_node_now(4, {RANKS_NOW_ENV: "2"}) == 2
    for bad in ("0", "5", "two"):
        with pytest.raises(ValueError, match=f"{RANKS_NOW_ENV}='{bad}': expected 1..4"):
            ranks_per_node_now(4, {RANKS_NOW_ENV: bad})


def test_a_checkpoint_tells_the_data_parallel_size_it_was_saved_at():
    zero = [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "config.yaml",
        "manifest.json",
    ]
    assert data_parallel_size(zero) == 2
    bf16 = [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)]
    assert data_parallel_size(bf16) == 4
    assert data_parallel_size(["mp_rank_00_model_states.pt"]) is None  # ZeRO-0: any size


def test_a_checkpoint_tells_its_optimizer_shards_in_rank_order_and_who_wrote_them():
    """The export reads the fp32 master weights by the layout of the optimizer that wrote them:
    DeepSpeed's bf16 mode (`bf16_` shards), ZeRO's shards, or none (ZeRO-0)."""
    bf16 = [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (10, 2, 0, 1)]
    assert optimizer_shards([*bf16, "mp_rank_00_model_states.pt"]) == [
        bf16[2],
        bf16[3],
        bf16[1],
        bf16[0],
    ]
    assert written_by_bf16_optimizer(optimizer_shards(bf16))
    zero = [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
    ]
    assert optimizer_shards(zero) == zero[:1] and not written_by_bf16_optimizer(zero[:1])
    assert optimizer_shards(["mp_rank_00_model_states.pt"]) == []
    assert not written_by_bf16_optimizer([])
