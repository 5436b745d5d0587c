"""clipforge's training step against open_clip_train's own loop, same model, batch, precision.

    .venv/bin/python bench/cpu_train_step.py [--steps 30] [--repeats 3] [--batch 128]

Both loops run in this process on the same in-memory batches (pre-normalised tensors: no loader
on either side), from the same initial weights, alternating which goes first:
  - open_clip_train.train.train_one_epoch, its real loop (torch AdamW, its clamp, its logging);
  - clipforge's step as train/loop.py runs it: the DeepSpeed engine of the run's config,
    contrastive_step, the per-step check and the temperature clamp;
  - the same with one knob off at a time: torch's multi-tensor AdamW instead of its fused
    kernel; the text tower's explicit float mask instead of the causal flag;
  - the same without the per-step check (`agree`: the host's one wait per step, before
    backward): what that wait costs, here.
`--loops NAME...` runs a subset (open_clip_train always runs: the ratios are to it).
The comparison is on synthetic in-memory data: open_clip_train's webdataset reader does not run
on webdataset 1.x. The loader is measured separately (bench/loader.py).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def batches(num: int, batch: int, image_size: int, context: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator)
    return [(images, torch.randint(1, 49000, (batch, context), generator=generator))] * num


class _Loader(list):
    num_batches: int
    num_samples: int


def open_clip_loop(model, data: list, lr: float) -> float:
    """samples/s of open_clip_train's train_one_epoch over `data` (fp32, one process)."""
    import torch
    from open_clip import ClipLoss
    from open_clip_train.train import train_one_epoch

    loader = _Loader(data)
    loader.num_batches, loader.num_samples = len(data), len(data) * len(data[0][0])
    args = SimpleNamespace(
        device="cpu",
        precision="fp32",
        distill=False,
        accum_freq=1,
        skip_scheduler=True,
        grad_clip_norm=1.0,
        horovod=False,
        log_every_n_steps=10**9,  # its log line reads loss.item(): once, at the end, as ours
        batch_size=len(data[0][0]),
        world_size=1,
        rank=0,
        local_rank=0,
        wandb=False,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-6)
    dataset = SimpleNamespace(dataloader=loader, set_epoch=lambda epoch: None)
    loss = ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True)
    logging.disable(logging.INFO)
    began = time.perf_counter()
    train_one_epoch(model, {"train": dataset}, loss, 0, optimizer, None, None, None, args)
    return loader.num_samples / (time.perf_counter() - began)


def clipforge_loop(model, data: list, lr: float, fused: bool = True, check: bool = True) -> float:
    """samples/s of clipforge's step as the train stage runs it (default params: ZeRO-1, fp32);
    `fused=False`: torch's multi-tensor AdamW instead of its fused kernel (the knob measured);
    `check=False`: no per-step check (no host read of the loss before backward)."""
    from clipforge.pipeline.params import load_pipeline_params
    from clipforge.train.config import batch_plan
    from clipforge.train.ds_config import deepspeed_config
    from clipforge.train.engine import clamp_logit_scale, create_engine
    from clipforge.train.loop import agree
    from clipforge.train.loss import contrastive_step, make_loss
    from clipforge.train.optim import WarmupCosine

    train = load_pipeline_params(
        None, [f"train.global_batch_size={len(data[0][0])}", f"train.lr={lr}"]
    ).train
    plan = batch_plan(train, world_size=1)
    config = deepspeed_config(train, plan, "cpu", "fp32")
    if not fused:
        config["optimizer"]["params"].pop("fused", None)
    engine = create_engine(model, config, WarmupCosine(0, 10**6, 0.0), 0.2)
    loss_fn = make_loss("clip", 0, 1)
    previous_norm = None

    def skip_if(loss) -> bool:  # the loop's per-step check, with the previous update's norm
        agreed = agree(loss, previous_norm, False, "cpu")
        return agreed.loss != agreed.loss

    def never(loss) -> bool:
        return False

    began = time.perf_counter()
    for images, texts in data:
        contrastive_step(engine, loss_fn, [(images, texts)], skip_if if check else never)
        clamp_logit_scale(engine, 100.0)
        previous_norm = engine.get_global_grad_norm()
    return len(data) * len(data[0][0]) / (time.perf_counter() - began)


LOOPS = [
    "open_clip_train",
    "clipforge",
    "clipforge-unfused-adamw",
    "clipforge-float-mask",
    "clipforge-no-check",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--loops", nargs="+", choices=LOOPS[1:], default=LOOPS[1:])
    args = parser.parse_args(argv)

    import torch

    from clipforge.model.config import ModelConfig
    from clipforge.model.factory import build_model, without_causal_flag
    from clipforge.train.dist import init_distributed
    from clipforge.train.engine import make_learned_scalars_1d

    init_distributed("cpu")
    torch.manual_seed(0)
    bundle = build_model(ModelConfig())  # the default recipe's model: clipforge-tiny, 64 px
    size = bundle.model_cfg["vision_cfg"]["image_size"]
    data = batches(args.steps, args.batch, size, bundle.model.context_length)
    warm = data[: args.warmup]
    # open_clip_train and the float-mask variant get the model exactly as plain open_clip builds
    # it; the other two clipforge's (text attention on the causal-flag path). Same weights.
    plain = without_causal_flag(bundle.model)
    names = [LOOPS[0], *[name for name in LOOPS[1:] if name in args.loops]]
    results: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        order = names[:: 1 if repeat % 2 == 0 else -1]
        for name in order:
            source = plain if name in ("open_clip_train", "clipforge-float-mask") else bundle.model
            model = copy.deepcopy(source)
            if name == "open_clip_train":
                open_clip_loop(model, warm, 1e-3)
                results[name].append(open_clip_loop(model, data, 1e-3))
            else:
                fused = name != "clipforge-unfused-adamw"
                check = name != "clipforge-no-check"
                make_learned_scalars_1d(model)
                clipforge_loop(model, warm, 1e-3, fused, check)  # its own engine: first steps
                results[name].append(clipforge_loop(copy.deepcopy(model), data, 1e-3, fused, check))
    med = {name: statistics.median(rates) for name, rates in results.items()}
    # each repeat's two runs are back to back: their ratio is robust to the machine's load drifting
    print(f"torch threads {torch.get_num_threads()}, batch {args.batch}, fp32, {args.steps} steps")
    for name, rates in results.items():
        print(f"{name:24s} median {med[name]:7.1f} samples/s  runs {[round(r, 1) for r in rates]}")
    for ours in names[1:]:
        ratios = [a / b for a, b in zip(results[ours], results["open_clip_train"])]
        print(
            f"{ours} / open_clip_train: median of the repeats' ratios "
            f"{statistics.median(ratios):.2f}x (ratios {[round(r, 2) for r in ratios]})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
