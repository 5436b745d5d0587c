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

SigLIP's loss (train.loss: siglip, open_clip's SigLipLoss) sums the sigmoid loss of every (image,
text) pair: each rank pairs its images with its own texts and, passed from rank to rank with
their gradients, every other rank's texts, so every pair of the global batch counts once. It
divides that sum by the rank's image count (the k micro-batches' rows, with the cache) where the
one-process global batch divides by all B of them: DeepSpeed averages the ranks' gradients, and
the mean over W ranks of sum_r / (B / W) is sum / B, the big batch's gradient with no
correction (tests/train/test_siglip.py, and test_accumulation.py on two ranks).

Distillation (train.distill_model) keeps it exact the same way: the teacher's features are
constants, computed once per micro-batch and concatenated over the step like the student's cache,
so every pass sees the full batch's teacher logits (open_clip's DistillClipLoss).

Two details make the sum exactly the big batch's gradient:
- the temperature (and SigLIP's bias) enters every one of the k losses, so each pass carries 1/k
  of its gradient (otherwise dL/dlogit_scale is counted k times);
- the cached and the recomputed forward of a micro-batch draw the same random numbers (dropout,
  e.g. in Hugging Face text towers), so the fresh features equal the cached ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import torch
from open_clip.loss import ClipLoss, DistillClipLoss, SigLipLoss

if TYPE_CHECKING:
    from clipforge.train.teacher import TeacherFeatures

# train.loss: clip | siglip; with a teacher (train.distill_model), ClipLoss's subclass
# WeightedDistillLoss
ContrastiveLoss: TypeAlias = ClipLoss | SigLipLoss


@dataclass(frozen=True)
class StepOutput:
    loss: torch.Tensor  # 0-dim, on the device: the full-batch loss of this rank's rows
    logit_scale: torch.Tensor  # 0-dim, on the device: the temperature exp(logit_scale) used
    skipped: bool = False  # `skip_if` refused the loss: no backward, no optimizer step
    logit_bias: torch.Tensor | None = None  # 0-dim, on the device: SigLIP's bias (CLIP: None)


def _never(loss: torch.Tensor) -> bool:
    return False


class WeightedDistillLoss(DistillClipLoss):
    """open_clip's DistillClipLoss as the one number a step back-propagates: its contrastive loss
    + `weight` x its distillation loss (the cross-entropy of the student's logits to the
    teacher's, both directions)."""

    def __init__(self, rank: int, world_size: int, weight: float):
        super().__init__(
            local_loss=True,
            gather_with_grad=True,
            cache_labels=True,
            rank=rank,
            world_size=world_size,
        )
        self.weight = weight

    def forward(self, *args, **kwargs) -> torch.Tensor:  # DistillClipLoss's arguments
        contrastive, distill = super().forward(*args, **kwargs)  # the pair, as one number
        return contrastive + self.weight * distill


def make_loss(
    loss: str, rank: int, world_size: int, distill_weight: float | None = None
) -> ContrastiveLoss:
    """open_clip's loss of train.loss over the global batch of `world_size` ranks; with a teacher
    (a distill_weight: train.distill_model, refused with siglip at params load),
    WeightedDistillLoss."""
    if loss == "siglip":
        return SigLipLoss(rank=rank, world_size=world_size)
    if distill_weight is not None:
        return WeightedDistillLoss(rank, world_size, distill_weight)
    return ClipLoss(
        local_loss=True, gather_with_grad=True, cache_labels=True, rank=rank, world_size=world_size
    )


def teacher_arguments(
    teacher: Callable[[torch.Tensor, torch.Tensor], TeacherFeatures] | None,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """DistillClipLoss's teacher arguments for the whole step: each micro-batch seen once by the
    teacher (no gradients), the features concatenated in the order of the student's cache; {}
    without a teacher."""
    if teacher is None:
        return {}
    seen = [teacher(images, texts) for images, texts in micro_batches]
    return {
        "dist_image_features": torch.cat([s.image for s in seen]),
        "dist_text_features": torch.cat([s.text for s in seen]),
        "dist_logit_scale": seen[0].logit_scale,
    }


def counted_once(value: torch.Tensor, num_passes: int) -> torch.Tensor:
    """`value` itself, whose gradient is 1/num_passes of the true one: summed over the passes of
    one step, it is counted once."""
    if num_passes == 1:
        return value
    frozen = value.detach()
    return frozen + (value - frozen) / num_passes


def learned_scalars(out: dict) -> list[torch.Tensor]:
    """The model's learned scalars from its output, 0-dim fp32, in the order open_clip's losses
    take them after the features: ClipLoss(image, text, logit_scale), SigLipLoss(image, text,
    logit_scale, logit_bias)."""
    return [out[n].float().reshape(()) for n in ("logit_scale", "logit_bias") if n in out]


def _encode(engine, images: torch.Tensor, texts: torch.Tensor, autocast) -> dict:
    with autocast():
        out = engine(image=images, text=texts)
    return {
        "image": out["image_features"].float(),
        "text": out["text_features"].float(),
        "scalars": learned_scalars(out),
    }


class _SameRandomness:
    """Snapshots of the random generators before each cached forward, replayed before the
    forward with gradients of the same micro-batch."""

    def __init__(self) -> None:
        self._states: list[tuple] = []

    def record(self) -> None:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        self._states.append((torch.get_rng_state(), cuda))

    def replay(self, j: int) -> None:
        if self._states:
            cpu, cuda = self._states[j]
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)


def accumulate_gradients(
    engine,
    loss_fn: ContrastiveLoss,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    skip_if: Callable[[torch.Tensor], bool] = _never,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    teacher: Callable[[torch.Tensor, torch.Tensor], TeacherFeatures] | None = None,
) -> StepOutput:
    """Forward/backward every micro-batch of one step, leaving the summed gradient for the
    optimizer step (DeepSpeed's engine.step() at the accumulation boundary, not taken here).

    `skip_if(loss)` sees the full-batch loss before any backward pass (a collective-safe point:
    every rank calls it once per step); when it says so, the step is dropped whole.
    `autocast` wraps each forward (bf16 autocast where the weights stay fp32).
    `teacher` (with a WeightedDistillLoss as `loss_fn`): the frozen model distilled from.
    """
    k = len(micro_batches)
    teacher_args = teacher_arguments(teacher, micro_batches)
    randomness = _SameRandomness()
    cached_images: list[torch.Tensor] = []
    cached_texts: list[torch.Tensor] = []
    if k > 1:
        with torch.no_grad():
            for images, texts in micro_batches:
                randomness.record()
                out = _encode(engine, images, texts, autocast)
                cached_images.append(out["image"])
                cached_texts.append(out["text"])
    first_loss = None
    for j, (images, texts) in enumerate(micro_batches):
        randomness.replay(j)
        out = _encode(engine, images, texts, autocast)
        if cached_images:
            all_images = torch.cat(cached_images[:j] + [out["image"]] + cached_images[j + 1 :])
            all_texts = torch.cat(cached_texts[:j] + [out["text"]] + cached_texts[j + 1 :])
        else:
            all_images, all_texts = out["image"], out["text"]
        scalars = [counted_once(s, k) for s in out["scalars"]]
        loss = loss_fn(all_images, all_texts, *scalars, **teacher_args)
        if j == 0:
            first_loss = loss.detach()
            if skip_if(first_loss):
                return _step_output(first_loss, out["scalars"], skipped=True)
        # Each pass back-propagates the whole loss through its own micro-batch only: no 1/k.
        engine.backward(loss, scale_wrt_gas=False)
        if j < k - 1:
            engine.step()  # a micro-step: DeepSpeed counts it; the update waits for the boundary
    assert first_loss is not None  # micro_batches is never empty
    return _step_output(first_loss, out["scalars"])


def _step_output(loss: torch.Tensor, scalars: list[torch.Tensor], skipped=False) -> StepOutput:
    """The step's loss and the learned scalars it used (learned_scalars' order). The bias is
    copied: open_clip's output is the parameter itself, which the update then changes."""
    bias = scalars[1].detach().clone() if len(scalars) > 1 else None
    return StepOutput(loss, scalars[0].detach(), skipped, bias)


def contrastive_step(
    engine,
    loss_fn: ContrastiveLoss,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    skip_if: Callable[[torch.Tensor], bool] = _never,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    teacher: Callable[[torch.Tensor, torch.Tensor], TeacherFeatures] | None = None,
) -> StepOutput:
    """One whole optimizer step: accumulate_gradients, then DeepSpeed's update."""
    out = accumulate_gradients(engine, loss_fn, micro_batches, skip_if, autocast, teacher)
    if not out.skipped:
        engine.step()
    return out
