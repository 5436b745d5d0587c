"""Run by test_export_and_eval.py in fresh interpreters: the fp32 weights the export reads from a
checkpoint (clipforge.train.engine.checkpoint_fp32_weights) against the engine's own fp32 master
weights, for every optimizer layout the train stage writes, on 1 or 2 ranks.

  python -m tests.support.checkpoint_weights_worker OUT.json DIR --world 2
  python -m tests.support.checkpoint_weights_worker OUT.json DIR --world 1 --resume

Each case is a run directory DIR/<case> written by the train stage's Checkpointer: a fresh engine
trains two steps and saves. A `locked` case locks the image tower first (train.lock_image), as the
train stage does: its weights, which no optimizer holds, are compared too, and with the start. With --resume, each case resumes from its newest checkpoint instead,
as the train stage does (saved at another data-parallel size: through DeepSpeed's universal
checkpoint), is compared with it, trains one more step and saves again. Rank 0 writes, per
checkpoint compared, the largest difference between the two sets of weights and the names found
in only one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tests.support.gradient_worker import _engine, _initial_model, _model, _rank_micro_batches
from tests.support.workers import on_ranks

# (ZeRO stage, precision, image tower locked): DeepSpeed's stage-0 model states, ZeRO-1's shards,
# its bf16 mode (BF16_Optimizer), ZeRO-2's and ZeRO-3's shards (fp32 weights under bf16
# autocast); with a locked tower, ZeRO-1 in bf16 (autocast then: the bf16 mode would round the
# locked weights) and ZeRO-3 (its own record of the locked weights). ZeRO-3 last: its engine
# patches torch.nn.functional.linear for the rest of the process.
CASES = (
    (0, "bf16", False),
    (1, "fp32", False),
    (1, "bf16", False),
    (1, "bf16", True),
    (2, "bf16", False),
    (3, "bf16", False),
    (3, "bf16", True),
)


def case_name(stage: int, precision: str, locked: bool) -> str:
    return f"zero{stage}-{precision}" + ("-locked" if locked else "")


def _master_weights(engine) -> dict:
    """The engine's fp32 master weights by name, and the weights of the locked parameters, which
    have none (a collective under ZeRO-3: every rank calls)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    weights = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            with deepspeed.zero.GatheredParameters([param]):  # a no-op below ZeRO-3
                weights[name] = param.detach().float().clone()
            continue
        master = safe_get_full_fp32_param(param)  # None without ZeRO: the weights are the master
        weights[name] = (param.detach() if master is None else master).float().clone()
    return weights


def _step(engine, stage: int, precision: str, locked: bool, world: int, rank: int) -> None:
    import torch

    from clipforge.train.ds_config import deepspeed_bf16, uses_autocast
    from clipforge.train.engine import forward_autocast
    from clipforge.train.loss import contrastive_step, make_loss

    dtype = torch.bfloat16 if deepspeed_bf16(precision, stage, locked) else torch.float32
    contrastive_step(
        engine,
        make_loss("clip", rank, world),
        _rank_micro_batches(1, world, rank, dtype),
        autocast=forward_autocast("cpu", uses_autocast(precision, stage, locked)),
    )


def _locked_engine(stage: int, world: int, precision: str):
    """An engine of the image tower locked as the train stage locks it (clipforge.train.optim)."""
    from clipforge.train.config import TrainConfig
    from clipforge.train.optim import lock_towers

    model = _model()
    lock_towers(model, TrainConfig(lock_image=True))
    return _engine(stage, 1, world, precision, model, locks_a_tower=True)


def _compare(engine, checkpoint: Path, rank: int) -> dict | None:
    import torch
    import torch.distributed as dist

    from clipforge.train.engine import checkpoint_fp32_weights

    master = _master_weights(engine)
    dist.barrier()  # every rank's shard written
    if rank != 0:
        return None
    read = checkpoint_fp32_weights(checkpoint)
    shared = master.keys() & read.keys()
    locked = [n for n, p in engine.module.named_parameters() if not p.requires_grad]
    start = _initial_model().state_dict()
    return {
        "only_engine": sorted(master.keys() - read.keys()),
        "only_checkpoint": sorted(read.keys() - master.keys()),
        "num_params": len(shared),
        "max_diff": max(
            (read[n].float().reshape(-1) - master[n].reshape(-1)).abs().max().item() for n in shared
        ),
        "dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
        "num_locked": len(locked),
        "locked_moved": sorted(n for n in locked if not torch.equal(read[n].float(), start[n])),
    }


def run(rank: int, world: int, args) -> None:
    import torch

    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    from clipforge.train.dist import init_distributed

    init_distributed("cpu")
    torch.set_num_threads(1)
    from clipforge.checkpoints.checkpointer import Checkpointer
    from clipforge.checkpoints.layout import tag_for

    results: dict = {}
    for stage, precision, locked in CASES:
        if locked:
            engine = _locked_engine(stage, world, precision)
        else:
            engine = _engine(stage, 1, world, precision)
        run_dir = Path(args.dir) / case_name(stage, precision, locked)
        checkpointer = Checkpointer(run_dir, keep=10, is_main=rank == 0)
        step = 0
        if args.resume:
            step = checkpointer.load(engine)["step"]
            results[f"{run_dir.name}-{tag_for(step)}-loaded"] = _compare(
                engine, run_dir / tag_for(step), rank
            )
        for _ in range(1 if args.resume else 2):
            _step(engine, stage, precision, locked, world, rank)
            step += 1
        checkpointer.save(engine, step, {"step": step}, "")
        results[f"{run_dir.name}-{tag_for(step)}"] = _compare(engine, run_dir / tag_for(step), rank)
        del engine
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1), encoding="utf-8")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("dir")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    on_ranks(run, args.world, args)


if __name__ == "__main__":
    main(sys.argv[1:])
