"""One optimizer step of contrastive training, with feature caching across micro-batches.

The global batch is the contrastive batch: every image is contrasted with every caption of the
step, across all micro-batches and ranks. Plain gradient accumulation would contrast each
micro-batch only with itself, a different (easier) objective. Instead, as open_clip's
`--accum-freq` does:
  1. encode every micro-batch without gradients and cache the features;
  2. for each micro-batch j, encode it again with gradients, put its fresh features in place of
     the cached ones, and back-propagate the full-batch loss; only micro-batch j's activations
     are alive, and the gradients of the k backward passes sum to the full-batch gradient.
ClipLoss with gather_with_grad extends the batch across ranks the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from open_clip.loss import ClipLoss


@dataclass(frozen=True)
class StepOutput:
    loss: float  # the full-batch contrastive loss (this rank's rows)
    logit_scale: float  # the temperature used, after the cap
    skipped: bool = False  # `skip_if` refused the loss: no backward, no optimizer step


def _never(loss: float) -> bool:
    return False


def make_clip_loss(rank: int, world_size: int) -> ClipLoss:
    return ClipLoss(
        local_loss=True, gather_with_grad=True, cache_labels=True, rank=rank, world_size=world_size
    )


def capped(logit_scale: torch.Tensor, max_logit_scale: float) -> torch.Tensor:
    """exp(logit_scale) capped; gradient-free above the cap, so the parameter stops growing."""
    return logit_scale.float().clamp(max=max_logit_scale)


def _encode(engine, images: torch.Tensor, texts: torch.Tensor) -> dict:
    out = engine(image=images, text=texts)
    return {
        "image": out["image_features"].float(),
        "text": out["text_features"].float(),
        "logit_scale": out["logit_scale"],
    }


def contrastive_step(
    engine,
    loss_fn: ClipLoss,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    max_logit_scale: float,
    skip_if: Callable[[float], bool] = _never,
) -> StepOutput:
    """Forward/backward every micro-batch of one step and let DeepSpeed take the optimizer step.

    `skip_if(loss)` sees the full-batch loss before any backward pass (a collective-safe point:
    every rank calls it once per step); when it says so, the step is dropped whole.
    """
    cached_images: list[torch.Tensor] = []
    cached_texts: list[torch.Tensor] = []
    if len(micro_batches) > 1:
        with torch.no_grad():
            for images, texts in micro_batches:
                out = _encode(engine, images, texts)
                cached_images.append(out["image"])
                cached_texts.append(out["text"])
    loss_value = scale_value = 0.0
    for j, (images, texts) in enumerate(micro_batches):
        out = _encode(engine, images, texts)
        if cached_images:
            all_images = torch.cat(cached_images[:j] + [out["image"]] + cached_images[j + 1 :])
            all_texts = torch.cat(cached_texts[:j] + [out["text"]] + cached_texts[j + 1 :])
        else:
            all_images, all_texts = out["image"], out["text"]
        scale = capped(out["logit_scale"], max_logit_scale)
        loss = loss_fn(all_images, all_texts, scale)
        if j == 0 and skip_if(loss.item()):
            return StepOutput(loss=loss.item(), logit_scale=scale.item(), skipped=True)
        # Each pass back-propagates the whole loss through its own micro-batch only: no 1/k.
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        loss_value, scale_value = loss.item(), scale.item()
    return StepOutput(loss=loss_value, logit_scale=scale_value)
