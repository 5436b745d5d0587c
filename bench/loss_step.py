#!/usr/bin/env python3
"""What each way of starting from open weights costs a training step, against the plain step.

Times clipforge's step (`contrastive_step`: the feature-cached accumulation) of one student in
four ways, side by side in one process: plain (CLIP's loss), SigLIP's loss (`train.loss:
siglip`), a frozen teacher (`train.distill_model`, its features computed once per micro batch)
and a locked image tower (`train.lock_image`, LiT: the optimizer holds the text tower only). The
cases alternate in each round (`--rounds`, default 6, of `--steps` 3 each, the order reversed
every other round), so that a shared machine's load drifts over all alike. The same batch, the
same initial weights; AdamW in plain PyTorch behind a minimal engine (one micro batch per step,
as the demo's CPU run), fp32 as a CPU run and its teacher are. Prints the medians, the median of
the rounds' ratios to the plain step and the FLOPs the formula of clipforge.train.flops predicts
for the teacher (student forward + backward, teacher forward).

    .venv/bin/python bench/loss_step.py [--student clipforge-micro] [--teacher clipforge-tiny]

Record the table in BENCHMARKS.md with the machine's load (`uptime`) before and after.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


class PlainEngine:
    """What contrastive_step asks of DeepSpeed's engine, for one micro batch per step."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def __call__(self, **inputs):
        return self.model(**inputs)

    def backward(self, loss, scale_wrt_gas: bool = False) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def step_seconds(student: str, teacher: str, batch: int, rounds: int, steps: int) -> dict:
    import torch

    from clipforge.model.config import ModelConfig
    from clipforge.model.factory import build_model
    from clipforge.train.config import TrainConfig
    from clipforge.train.loss import contrastive_step, make_loss
    from clipforge.train.optim import lock_towers
    from clipforge.train.teacher import Teacher

    torch.manual_seed(0)
    start = build_model(ModelConfig(name=student)).model.state_dict()
    frozen = Teacher(build_model(ModelConfig(name=teacher)).model, torch.float32)
    size = frozen.model.visual.image_size[0]
    generator = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randn(batch, 3, size, size, generator=generator),
            torch.randint(1, 49000, (batch, 72), generator=generator),
        )
    ]
    cases = {
        "plain": ("clip", None, TrainConfig()),
        "siglip": ("siglip", None, TrainConfig(loss="siglip")),
        "teacher": ("clip", frozen, TrainConfig()),
        "locked image": ("clip", None, TrainConfig(lock_image=True)),
    }
    engines, losses = {}, {}
    for name, (loss, teaching, train) in cases.items():
        model = build_model(ModelConfig(name=student), loss).model
        model.load_state_dict(start, strict=False)  # SigLIP's bias keeps its own start
        lock_towers(model, train)
        trainable = [p for p in model.parameters() if p.requires_grad]
        engines[name] = PlainEngine(model, torch.optim.AdamW(trainable, lr=1e-4))
        losses[name] = make_loss(loss, 0, 1, 1.0 if teaching else None)
    for name in cases:  # warm-up, untimed: the first step of a process pays for allocations
        contrastive_step(engines[name], losses[name], data, teacher=cases[name][1])
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(rounds):
        for name in list(cases)[:: 1 if round_ % 2 == 0 else -1]:
            teaching = cases[name][1]
            began = time.perf_counter()
            for _ in range(steps):
                contrastive_step(engines[name], losses[name], data, teacher=teaching)
            times[name].append((time.perf_counter() - began) / steps)
    return times


def predicted_gflop(student: str, teacher: str) -> tuple[float, float]:
    import open_clip

    from clipforge.model.names import register_bundled_configs
    from clipforge.train.flops import flops_per_sample

    register_bundled_configs()
    trained = flops_per_sample(open_clip.get_model_config(student))
    forward = flops_per_sample(open_clip.get_model_config(teacher), False, False)
    assert trained and forward
    return trained / 1e9, forward / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", default="clipforge-micro")
    parser.add_argument("--teacher", default="clipforge-tiny")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    times = step_seconds(args.student, args.teacher, args.batch, args.rounds, args.steps)
    trained, forward = predicted_gflop(args.student, args.teacher)
    print(f"student {args.student}, teacher {args.teacher}, batch {args.batch}")
    print(
        f"predicted per pair: student forward + backward {trained:.3f} GFLOP, teacher forward "
        f"{forward:.3f} GFLOP: with the teacher {(trained + forward) / trained:.2f}x"
    )
    print("| step | s (median) | rounds, s | cost, median of the rounds' ratios |")
    print("|---|---:|---|---:|")
    base = times["plain"]
    for name, seconds in times.items():
        rounds = ", ".join(f"{t:.2f}" for t in seconds)
        ratio = statistics.median(t / b for b, t in zip(base, seconds))
        print(f"| {name} | {statistics.median(seconds):.3f} | {rounds} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
