"""What the optimizer steps: the towers locked, AdamW's parameter groups, the lr schedule.

Locked towers are open_clip's own (`lock_image_tower`, `lock_text_tower`, as open_clip_train's
`--lock-image`, `--lock-text` apply them): a locked parameter has requires_grad False, and the
parameter groups, all the optimizer ever sees, hold only those that train.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from clipforge.fields import ConfigError

if TYPE_CHECKING:
    from clipforge.train.config import TrainConfig

# The parameters of a CLIP model in neither tower: the temperature (and SigLIP's bias).
_SHARED = ("logit_scale", "logit_bias")


def lock_towers(model: torch.nn.Module, train: TrainConfig) -> dict[str, int]:
    """Lock the towers train.lock_* ask for, with open_clip's own methods, before the engine
    exists (DeepSpeed's optimizer takes the parameters that train when it is built). Returns the
    number of parameters (elements) locked per tower; a lock that locked nothing (its last N
    groups being the whole tower) is refused."""
    open_clip_model: Any = model  # open_clip's CLIP or CustomTextCLIP
    if train.lock_image:
        open_clip_model.lock_image_tower(
            unlocked_groups=train.lock_image_unlocked_groups,
            freeze_bn_stats=train.lock_image_freeze_bn_stats,
        )
    if train.lock_text:
        open_clip_model.lock_text_tower(
            unlocked_layers=train.lock_text_unlocked_layers,
            freeze_layer_norm=train.lock_text_freeze_layer_norm,
        )
    locked = {"image": 0, "text": 0}
    for name, param in model.named_parameters():
        if not param.requires_grad and name not in _SHARED:
            locked["image" if name.startswith("visual.") else "text"] += param.numel()
    for tower, lock, detail in (
        ("image", train.lock_image, "lock_image_unlocked_groups"),
        ("text", train.lock_text, "lock_text_unlocked_layers"),
    ):
        if lock and not locked[tower]:
            raise ConfigError(
                f"train.{detail}: {getattr(train, detail)} leaves the whole {tower} tower to "
                f"train, none of it locked; lower it, or set train.lock_{tower}: false"
            )
    return locked


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Gains, biases, 1-d embeddings (class token) and the temperature are not decayed.

    Tested on the parameter's shape rather than names where possible: after clipforge gives
    logit_scale the shape [1] (see engine.py) it is 1-d like every other exempt tensor.
    """
    return param.ndim < 2 or name.endswith(".bias") or "logit_scale" in name


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters, decayed or exempt; a locked one is in neither, so the optimizer
    holds no state for it and never steps it (weight decay included)."""
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
