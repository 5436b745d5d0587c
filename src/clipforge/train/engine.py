"""Everything DeepSpeed-specific: engine set-up, the ZeRO quirks, reading fp32 weights back.

ZeRO quirks handled here, so the loop can stay plain:
- DeepSpeed cannot broadcast 0-dim parameters, and open_clip's `logit_scale` is one: it gets the
  shape [1] for training and back [] on export.
- Under ZeRO-3 a parameter outside forward is an empty placeholder, so an in-place clamp of
  `logit_scale` (open_clip's way of capping the temperature) silently does nothing, and with bf16
  the optimizer's fp32 master copy would overwrite it anyway. The cap is applied in the loss
  instead (loss.py), and to the exported value.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from clipforge.train.optim import WarmupCosine, make_scheduler, param_groups


def make_logit_scale_1d(model: torch.nn.Module) -> None:
    model.logit_scale = torch.nn.Parameter(model.logit_scale.detach().reshape(1))


def create_engine(
    model: torch.nn.Module, ds_config: dict, schedule: WarmupCosine, weight_decay: float
):
    import deepspeed

    make_logit_scale_1d(model)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, weight_decay),
        config=ds_config,
        lr_scheduler=make_scheduler(schedule),
    )
    return engine


def fp32_state_dict(checkpoint_dir: Path, tag: str, max_logit_scale: float) -> dict:
    """fp32 weights of a saved checkpoint, in plain open_clip form (read from the ZeRO partitions,
    so bf16 training still exports its fp32 master weights)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    state = {name: tensor.detach().float().contiguous().clone() for name, tensor in state.items()}
    state["logit_scale"] = state["logit_scale"].reshape(()).clamp(max=math.log(max_logit_scale))
    return state


def replicas_in_sync(engine) -> float:
    """Largest difference between ranks' copies of the weights (0.0 when identical).

    Under ZeRO-1/2 every rank holds the full weights; a silent desynchronisation (a rank that
    skipped a step, a non-deterministic reduction) would show here. ZeRO-3 keeps one shard per
    rank, so there is nothing to compare.
    """
    import torch.distributed as dist

    if engine.zero_optimization_stage() >= 3 or dist.get_world_size() == 1:
        return 0.0
    sums = torch.stack([p.detach().double().sum() for p in engine.module.parameters()])
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    return max((g - gathered[0]).abs().max().item() for g in gathered)
