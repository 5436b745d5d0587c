"""Everything DeepSpeed-specific: engine set-up, the ZeRO quirks, fp32 weights from checkpoints.

Engine set-up, the ZeRO quirks, and reading fp32 weights back from a checkpoint whichever
optimizer wrote it.

ZeRO quirks handled here, so the loop can stay plain:
- DeepSpeed cannot broadcast 0-dim parameters, and open_clip's `logit_scale` (and SigLIP's
  `logit_bias`) are: they get the shape [1] for training and back [] on export.
- open_clip caps the temperature by clamping `logit_scale` in place after each step. Under
  DeepSpeed that alone does nothing: the optimizer steps its own fp32 master copy and writes it
  back over the weights, and under ZeRO-3 the weight outside forward is an empty placeholder.
  `clamp_logit_scale` clamps both copies through DeepSpeed's own accessors, at every stage.
  (A clamp inside the loss instead would have no gradient above the cap, and a master weight
  pushed past it by momentum would stay there.)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path

import torch

from clipforge.checkpoints.layout import optimizer_shards, written_by_bf16_optimizer
from clipforge.train.optim import WarmupCosine, make_scheduler, param_groups

# open_clip's 0-dim learned scalars: the temperature, and SigLIP's bias where the model has one
LEARNED_SCALARS = ("logit_scale", "logit_bias")


def make_learned_scalars_1d(model: torch.nn.Module) -> None:
    """logit_scale (and logit_bias) of shape [1], which DeepSpeed can broadcast."""
    for name in LEARNED_SCALARS:
        value = getattr(model, name, None)
        if isinstance(value, torch.Tensor):  # open_clip sets logit_bias None without SigLIP
            setattr(model, name, torch.nn.Parameter(value.detach().reshape(1)))


def _no_parameter_as_output(module, inputs, output):
    """A forward hook: each parameter the model returns as it is (SigLIP's logit_bias) comes out
    as a view of itself, with a grad_fn like every other output.

    DeepSpeed 0.19 (not the image's 0.14) starts its backward in a hook on the first output that
    has a grad_fn, and there clears the gradients (BF16_Optimizer.clear_lp_grads). A parameter
    returned as it is gets no hook, and its gradient, accumulated before any other output's hook
    fires, was cleared: in DeepSpeed's bf16 mode the bias never learned."""
    if not isinstance(output, dict):
        return output
    return {
        name: value.view_as(value)
        if isinstance(value, torch.nn.Parameter) and value.requires_grad
        else value
        for name, value in output.items()
    }


def create_engine(
    model: torch.nn.Module,
    ds_config: dict,
    schedule: WarmupCosine,
    weight_decay: float,
    compile_model: bool = False,
    compile_backend: str | None = None,
):
    import deepspeed

    make_learned_scalars_1d(model)
    model.register_forward_hook(_no_parameter_as_output)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, weight_decay),
        config=ds_config,
        lr_scheduler=make_scheduler(schedule),
    )
    if compile_model:
        # torch.compile of the module's forward, DeepSpeed's hooks kept; the backend defaults to
        # the accelerator's (inductor). The CPU stand-ins (the benchmark's dry run,
        # tests/train/test_compiled_step.py) pass `aot_eager`: dynamo's and AOTAutograd's
        # graphs, run eagerly, without a C++ toolchain.
        engine.compile(**({"backend": compile_backend} if compile_backend else {}))
    return engine


def clamp_logit_scale(engine, max_logit_scale: float) -> None:
    """Cap the temperature at the step boundary, on the weights and the fp32 master weights
    (every rank calls this: it gathers under ZeRO-3)."""
    import deepspeed
    from deepspeed import utils

    cap = math.log(max_logit_scale)
    param = engine.module.logit_scale
    # A no-op gather below ZeRO-3; under it, rank 0's clamped value is partitioned back.
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
        param.clamp_(max=cap)
    if hasattr(param, "ds_id"):
        # ZeRO-3: each rank clamps its own slice of the master weight. (The full-value setter
        # fails for a tensor smaller than the number of ranks, as this one-element one.)
        local = utils.safe_get_local_fp32_param(param)
        utils.safe_set_local_fp32_param(param, local.clamp(max=cap))
        return
    master = utils.safe_get_full_fp32_param(param)
    if master is not None:
        utils.safe_set_full_fp32_param(param, master.clamp(max=cap))


def forward_autocast(device: str, enabled: bool) -> Callable[[], AbstractContextManager]:
    """The context each forward runs in: bf16 autocast over fp32 weights, or nothing."""
    if not enabled:
        return nullcontext
    return partial(torch.autocast, device_type=device, dtype=torch.bfloat16)


def fp32_state_dict(checkpoint_dir: Path, tag: str, max_logit_scale: float) -> dict:
    """fp32 weights of a saved checkpoint, in plain open_clip form: the fp32 master weights
    whichever optimizer wrote it (ZeRO-1/2/3, DeepSpeed's bf16 mode), so bf16 training exports
    them rather than its bf16 copy."""
    state = checkpoint_fp32_weights(checkpoint_dir / tag)
    state = {name: tensor.detach().float().contiguous().clone() for name, tensor in state.items()}
    for name in LEARNED_SCALARS:
        if name in state:
            state[name] = state[name].reshape(())
    state["logit_scale"] = state["logit_scale"].clamp(max=math.log(max_logit_scale))
    return state


def checkpoint_fp32_weights(checkpoint: Path) -> dict:
    """Every parameter and buffer of the model a DeepSpeed checkpoint holds, in fp32, by the name
    the module gives it; read by each optimizer's layout:
    - ZeRO-1/2/3: DeepSpeed's zero_to_fp32 (the shards of the fp32 master weights, merged);
    - DeepSpeed's bf16 mode: its BF16_Optimizer partitions the fp32 master weights as ZeRO-1 does
      (each parameter group flattened in order, padded at its end to a multiple of 2 x ranks, cut
      into one equal slice per rank), but its shards record no ZeRO stage, and zero_to_fp32
      refuses them: their slices go to zero_to_fp32's merge of ZeRO-1/2 slices directly;
    - ZeRO stage 0 (fp32 weights, clipforge keeps bf16 there as autocast): the weights whole,
      from the model states;
    and the parameters of a locked tower, which no optimizer holds, where each layout keeps them
    (`_with_locked_weights`)."""
    from deepspeed.utils import zero_to_fp32

    shards = optimizer_shards(os.listdir(checkpoint))
    if not shards:
        model_states = zero_to_fp32.get_model_state_file(str(checkpoint), 0)
        return torch.load(model_states, map_location="cpu", weights_only=False)["module"]
    if not written_by_bf16_optimizer(shards):
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
            str(checkpoint.parent), tag=checkpoint.name
        )
    else:
        state = _bf16_optimizer_fp32_weights(checkpoint, shards)
    return _with_locked_weights(state, checkpoint)


def _with_locked_weights(state: dict, checkpoint: Path) -> dict:
    """`state` with the parameters no optimizer steps (a locked tower, train.lock_*) that it
    lacks. ZeRO-2 and 3 save those beside the shards, and zero_to_fp32 reads them; ZeRO-1 (and
    the bf16 mode) keep them in the module's weights only, whole (ZeRO-1 partitions no weight),
    and in fp32 where a tower is locked (clipforge.train.ds_config.deepspeed_bf16)."""
    from deepspeed.utils import zero_to_fp32

    model_states = zero_to_fp32.get_model_state_files(str(checkpoint))[0]
    module = torch.load(model_states, map_location="cpu", weights_only=False)["module"]
    missing = {name: tensor for name, tensor in module.items() if name not in state}
    return {**state, **missing}


def _bf16_optimizer_fp32_weights(checkpoint: Path, shards: list[str]) -> dict:
    """The fp32 master weights of DeepSpeed's bf16 mode, merged from its ZeRO-1-like slices."""
    from deepspeed.checkpoint.constants import (
        OPTIMIZER_STATE_DICT,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )
    from deepspeed.utils import zero_to_fp32

    slices = [
        torch.load(checkpoint / shard, map_location="cpu", weights_only=False)[
            OPTIMIZER_STATE_DICT
        ][SINGLE_PARTITION_OF_FP32_GROUPS]
        for shard in shards
    ]
    model_states = zero_to_fp32.parse_model_states(
        zero_to_fp32.get_model_state_files(str(checkpoint))
    )
    # world size, slices by rank, model states, exclude_frozen_parameters
    return zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
        len(shards), slices, model_states, False
    )


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
