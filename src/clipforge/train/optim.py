"""AdamW parameter groups and the learning-rate schedule (pure functions)."""

from __future__ import annotations

import math

import torch


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Gains, biases, 1-d embeddings (class token) and the temperature are not decayed.

    Tested on the parameter's shape rather than names where possible: after clipforge gives
    logit_scale the shape [1] (see engine.py) it is 1-d like every other exempt tensor.
    """
    return param.ndim < 2 or name.endswith(".bias") or "logit_scale" in name


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay: list[torch.nn.Parameter] = []
    exempt: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (exempt if no_weight_decay(name, param) else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": exempt, "weight_decay": 0.0},
    ]


class WarmupCosine:
    """lr multiplier: linear warm-up over `warmup_steps`, then cosine decay to `min_ratio`.

    An object rather than a closure so LambdaLR can put its state into checkpoints.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float):
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(schedule: WarmupCosine):
    """The factory deepspeed.initialize wants: optimizer -> scheduler (stepped per optimizer step)."""
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
