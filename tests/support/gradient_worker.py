"""Run by test_big_batch_gradients.py in fresh interpreters: accumulated gradients against one
big batch's, and the temperature cap on DeepSpeed's master weights.

  python -m tests.support.gradient_worker OUT.json --world 2 --stages 1 2 --accum 1 2 4 \
      [--loss siglip|distill]

Every rank computes the reference itself (one forward/backward of the whole global batch in plain
torch, before any ZeRO-3 engine patches torch.nn.functional.linear); then, per ZeRO stage and
accumulation k, a fresh DeepSpeed engine from the same initial weights runs this rank's k
micro-batches through `accumulate_gradients`, and every gradient is read back with DeepSpeed's
`safe_get_full_grad` before the optimizer step. Rank 0 writes the comparison as JSON.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import sys

from tests.support.workers import on_ranks

GLOBAL = 16
IMAGE_SIZE = 32
LR = 1e-3
# The teacher of the distillation cases: another architecture than the student (clipforge-tiny),
# narrower, with larger patches and its own embedding width (the real runs distil tiny into it).
TEACHER = "clipforge-micro"
DISTILL_WEIGHT = 0.5


def _batch():
    import torch

    generator = torch.Generator().manual_seed(0)
    images = torch.randn(GLOBAL, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    texts = torch.randint(1, 49000, (GLOBAL, 72), generator=generator)
    return images, texts


@functools.cache
def _initial_model(loss: str = "clip"):
    import torch

    from clipforge.model.config import ModelConfig
    from clipforge.model.factory import build_model
    from clipforge.train.engine import make_learned_scalars_1d

    torch.manual_seed(0)
    model = build_model(ModelConfig(image_size=IMAGE_SIZE), loss).model
    make_learned_scalars_1d(model)
    with torch.no_grad():  # a temperature (and bias) away from the initial ones: a generic point
        model.logit_scale.fill_(math.log(20.0))
        if model.logit_bias is not None:  # train.loss: siglip
            model.logit_bias.fill_(-3.0)
    return model


def _model(loss: str = "clip"):
    """A fresh copy of the same initial weights (building one through open_clip takes seconds)."""
    return copy.deepcopy(_initial_model(loss))


@functools.cache
def _teacher():
    """A distillation teacher of another architecture than the student, with its own weights and
    temperature, in fp32 as a CPU run's teacher is."""
    import torch

    from clipforge.model.config import ModelConfig
    from clipforge.model.factory import build_model
    from clipforge.train.teacher import Teacher

    torch.manual_seed(1)
    teacher = build_model(ModelConfig(name=TEACHER, image_size=IMAGE_SIZE)).model
    with torch.no_grad():  # a temperature of its own, not the student's
        teacher.logit_scale.fill_(math.log(50.0))
    return Teacher(teacher, torch.float32)


def _loss(loss: str, rank: int, world: int):
    """The loss of a case: train.loss (clip, siglip), or `distill`: CLIP's with the teacher."""
    from clipforge.train.loss import make_loss

    if loss == "distill":
        return make_loss("clip", rank, world, DISTILL_WEIGHT)
    return make_loss(loss, rank, world)


def reference_gradients(loss: str) -> dict:
    from clipforge.train.loss import learned_scalars

    model = _model("clip" if loss == "distill" else loss)
    images, texts = _batch()
    out = model(image=images, text=texts)
    teacher = {}
    if loss == "distill":  # the teacher's features of the whole batch at once
        seen = _teacher()(images, texts)
        teacher = {
            "dist_image_features": seen.image,
            "dist_text_features": seen.text,
            "dist_logit_scale": seen.logit_scale,
        }
    value = _loss(loss, 0, 1)(
        out["image_features"], out["text_features"], *learned_scalars(out), **teacher
    )
    value.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _engine(stage: int, k: int, world: int, precision: str, model=None, locks_a_tower=False):
    from clipforge.pipeline.params import load_pipeline_params
    from clipforge.train.config import BatchPlan
    from clipforge.train.ds_config import deepspeed_config
    from clipforge.train.engine import create_engine
    from clipforge.train.optim import WarmupCosine

    micro = GLOBAL // (k * world)
    config = load_pipeline_params(
        None,
        [
            f"train.global_batch_size={GLOBAL}",
            f"train.micro_batch_size={micro}",
            f"train.zero_stage={stage}",
            f"train.lr={LR}",
            "train.grad_clip_norm=0",
        ],
    )
    train = dataclasses.replace(config.train, lock_image=locks_a_tower)
    plan = BatchPlan(GLOBAL, micro, k, world)
    ds_config = deepspeed_config(train, plan, "cpu", precision)
    return create_engine(model or _model(), ds_config, WarmupCosine(0, 10, 0.0), 0.2)


def _rank_micro_batches(k: int, world: int, rank: int, dtype):
    """Rank r's micro-batch j holds rows [(j*W + r)*m, +m) of the step, as train/loader.py lays out."""
    images, texts = _batch()
    m = GLOBAL // (k * world)
    rows = [slice((j * world + rank) * m, (j * world + rank + 1) * m) for j in range(k)]
    return [(images[r].to(dtype), texts[r]) for r in rows]


def accumulated_gradients(
    stage: int, k: int, world: int, rank: int, precision: str, loss: str
) -> dict:
    import torch
    from deepspeed.utils import safe_get_full_grad

    from clipforge.train.ds_config import deepspeed_bf16, uses_autocast
    from clipforge.train.engine import forward_autocast
    from clipforge.train.loss import accumulate_gradients

    engine = _engine(stage, k, world, precision, _model("clip" if loss == "distill" else loss))
    dtype = torch.bfloat16 if deepspeed_bf16(precision, stage) else torch.float32
    accumulate_gradients(
        engine,
        _loss(loss, rank, world),
        _rank_micro_batches(k, world, rank, dtype),
        autocast=forward_autocast("cpu", uses_autocast(precision, stage)),
        teacher=_teacher() if loss == "distill" else None,
    )
    grads = {}
    for name, param in engine.module.named_parameters():  # collective under ZeRO: same order
        grads[name] = safe_get_full_grad(param).detach().float().clone().reshape(-1)
    engine.step()
    accum_dtype = engine.get_data_types()[1] if hasattr(engine, "get_data_types") else None
    weight_dtype = next(engine.module.parameters()).dtype
    del engine
    return {"grads": grads, "accum_dtype": str(accum_dtype), "weight_dtype": str(weight_dtype)}


def compare(grads: dict, reference: dict, rtol: float) -> dict:
    """name -> max |g - ref| / max |ref| for every parameter (all of them, logit_scale too)."""
    errors = {}
    for name, ref in reference.items():
        ref = ref.reshape(-1)
        scale = ref.abs().max().item() or 1.0
        errors[name] = (grads[name] - ref).abs().max().item() / scale
    return {
        "num_params": len(errors),
        "max_error": max(errors.values()),
        "mismatched": sorted(n for n, e in errors.items() if e > rtol),
        "logit_scale_error": errors["logit_scale"],
        "logit_bias_error": errors.get("logit_bias"),  # train.loss: siglip
    }


def clamp_check(stage: int, world: int, rank: int) -> dict:
    """A temperature far above the cap: clamped on both copies; one step later it stays near the
    cap (were only the weights clamped, the step would copy the master's 7.0 back)."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from clipforge.train.engine import clamp_logit_scale
    from clipforge.train.loss import contrastive_step, make_loss

    model = _model()
    with torch.no_grad():
        model.logit_scale.fill_(7.0)  # exp(7) = 1097, far above the cap of 100
    engine = _engine(stage, 1, world, "fp32", model)
    clamp_logit_scale(engine, 100.0)
    master_after_clamp = safe_get_full_fp32_param(engine.module.logit_scale).item()
    contrastive_step(
        engine, make_loss("clip", rank, world), _rank_micro_batches(1, world, rank, None)
    )
    param = engine.module.logit_scale
    with deepspeed.zero.GatheredParameters([param]):
        weight_after_step = param.detach().float().item()
    del engine
    return {"master_after_clamp": master_after_clamp, "weight_after_step": weight_after_step}


def run(rank: int, world: int, args) -> None:
    import torch

    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    from clipforge.train.dist import init_distributed

    init_distributed("cpu")
    torch.set_num_threads(1)
    reference = reference_gradients(args.loss)
    results: dict = {}
    for stage in args.stages:
        for k in args.accum:
            got = accumulated_gradients(stage, k, world, rank, args.precision, args.loss)
            results[f"zero{stage}-k{k}"] = {
                **compare(got["grads"], reference, args.rtol),
                "accum_dtype": got["accum_dtype"],
                "weight_dtype": got["weight_dtype"],
            }
        if args.clamp:
            results[f"zero{stage}-clamp"] = clamp_check(stage, world, rank)
    if rank == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--stages", type=int, nargs="+", default=[1])
    parser.add_argument("--accum", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--clamp", action="store_true")
    parser.add_argument(
        "--loss",
        choices=["clip", "siglip", "distill"],
        default="clip",
        help="train.loss, or distill: CLIP's with a teacher (DistillClipLoss)",
    )
    args = parser.parse_args(argv)
    on_ranks(run, args.world, args)


if __name__ == "__main__":
    main(sys.argv[1:])
