"""Validation during training: contrastive loss and retrieval recall on the held-out val split.

Recall is counted as the eval stage counts it (clipforge.metrics.retrieval). A caption's
relevant images are those whose own caption is the same text (compared as token ids): the
built-in data repeats captions, and an identical caption of another image is not a miss. Only
the first `train.val_retrieval_samples` pairs are ranked, because recall depends on the gallery
size; every batch still counts towards the loss.

ZeRO-3 gathers each layer's parameters from all ranks inside every forward, so all ranks must
run the same number of forwards or the run hangs. The val loader gives every rank the same
number of equal-sized batches (train/stage.py) and this function runs exactly one forward per
batch on every rank, whatever it keeps for ranking; the kept features then have the same
shape on every rank, which all_gather needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from clipforge.metrics.retrieval import retrieval_metrics
from clipforge.metrics.sizes import MIN_QUERIES
from clipforge.train.loss import learned_scalars


def validation_due(
    done: int, steps_per_epoch: int, total_steps: int, val_every_steps: int | None
) -> bool:
    """After optimizer step `done`: at epoch ends, at the end, and every val_every_steps."""
    return (
        done % steps_per_epoch == 0
        or done == total_steps
        or bool(val_every_steps and done % val_every_steps == 0)
    )


def validation_metrics(
    model,
    loss_fn: Callable,
    batches: Iterable,
    to_device: Callable,
    device: str,
    retrieval_samples: int,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> dict[str, float]:
    """{"loss", "t2i_r01", ..., "mean_recall"}, the same on every rank, computed in eval mode
    (no dropout: a deterministic measurement); the model's mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _metrics(model, loss_fn, batches, to_device, device, retrieval_samples, autocast)
    finally:
        model.train(was_training)


def _metrics(model, loss_fn, batches, to_device, device, retrieval_samples, autocast) -> dict:
    world = _world_size()
    keep_per_rank = math.ceil(retrieval_samples / world)
    total = torch.zeros(2, device=device)
    kept: dict[str, list[torch.Tensor]] = {"image": [], "text": [], "tokens": []}
    num_kept = 0
    for batch in batches:
        images, tokens = to_device(batch)
        with autocast():
            out = model(image=images, text=tokens)
        image_features, text_features = out["image_features"].float(), out["text_features"].float()
        loss = loss_fn(image_features, text_features, *learned_scalars(out))
        total += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        take = min(keep_per_rank - num_kept, images.shape[0])
        if take > 0:
            kept["image"].append(image_features[:take])
            kept["text"].append(text_features[:take])
            kept["tokens"].append(tokens[:take])
            num_kept += take
    if world > 1:
        dist.all_reduce(total)
    if total[1] == 0:  # no validation split
        return {}
    metrics = {"loss": (total[0] / total[1]).item()}
    image_features, text_features, tokens = (
        _gather(torch.cat(kept[k]))[:retrieval_samples] for k in ("image", "text", "tokens")
    )
    # one id per distinct caption: relevance without an N x N x context-length comparison
    caption_ids = torch.unique(tokens, dim=0, return_inverse=True)[1]
    relevant = caption_ids[:, None] == caption_ids[None, :]
    if len(relevant) >= MIN_QUERIES:  # the data stage holds a val split to that too
        metrics.update(retrieval_metrics(image_features, text_features, relevant))
    return metrics


def _world_size() -> int:
    """Ranks in the process group; a world of one without one (e.g. a notebook, a unit test)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(local: torch.Tensor) -> torch.Tensor:
    """Rank 0's rows, then rank 1's, ...: the same tensor on every rank."""
    if _world_size() == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts)
