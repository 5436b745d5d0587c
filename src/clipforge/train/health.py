"""The readings of the training-health alerts (clipforge.alerts.health), taken for free.

In-batch accuracy needs the step's features, which live inside the contrastive step. The loss
function is wrapped so that its last call leaves them (detached, on the device; a reference,
no copy and no compute); accuracy is computed from them only at a log interval, where the loop
reads the device anyway. A step therefore pays nothing for the rule, a log interval one
B x B matrix product per rank, small beside a forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from clipforge.alerts.health import HealthReading


class FeatureTap:
    """`loss_fn` itself, remembering the (image, text) features of its last call."""

    def __init__(self, loss_fn: Callable) -> None:
        self.loss_fn = loss_fn
        self._features: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, image_features, text_features, logit_scale, *args, **kwargs):
        self._features = (image_features.detach(), text_features.detach())
        return self.loss_fn(image_features, text_features, logit_scale, *args, **kwargs)

    def accuracy(self) -> tuple[torch.Tensor, int] | None:
        """(top-1 accuracy, both directions averaged, as a 0-dim tensor on the device; the
        number of pairs) over the rank's pairs of the last step, or None before any."""
        if self._features is None:
            return None
        image, text = self._features
        with torch.no_grad():
            logits = image @ text.T
            labels = torch.arange(logits.shape[0], device=logits.device)
            hits = (logits.argmax(dim=1) == labels).float().mean()
            hits = (hits + (logits.argmax(dim=0) == labels).float().mean()) / 2
        return hits, logits.shape[0]


def health_reading(
    step: int, tap: FeatureTap, logit_scale: torch.Tensor, max_logit_scale: float
) -> HealthReading:
    """One device read for both numbers, at a point where the loop reads the device anyway."""
    measured = tap.accuracy()
    if measured is None:
        return HealthReading(step, float(logit_scale), max_logit_scale)
    accuracy, pairs = measured
    scale, hits = torch.stack([logit_scale.float().reshape(()), accuracy]).tolist()
    return HealthReading(step, scale, max_logit_scale, hits, pairs)
