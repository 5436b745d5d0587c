"""Zero-shot classification accuracy (top-1, top-5), as the eval stage reports it.

CLIP's zero-shot recipe: each class is the mean of its prompts' L2-normalised text embeddings,
normalised again; an image's prediction is the class whose embedding is most similar to its
own. Accuracy is the percent of images whose class is among the k most similar.
"""

from __future__ import annotations

from collections.abc import Sequence

KS = (1, 5)
METRIC_KEYS = tuple(f"top{k}" for k in KS)


def class_embeddings(prompt_features, num_templates: int):
    """[classes * templates, d] prompt features (class-major, L2-normalised) -> [classes, d]."""
    per_class = prompt_features.reshape(-1, num_templates, prompt_features.shape[-1]).mean(dim=1)
    return per_class / per_class.norm(dim=-1, keepdim=True)


def zero_shot_accuracy(image_features, class_features, labels: Sequence[int]) -> dict[str, float]:
    """top1, top5 in percent; features L2-normalised. Top-k over k classes or fewer is 100%
    whatever the model, so it is left out (top5 with 5 classes or fewer)."""
    import torch

    num_classes = class_features.shape[0]
    ks = [k for k in KS if k < num_classes]
    if not ks:
        raise ValueError(f"zero-shot accuracy over {num_classes} class")
    similarity = image_features @ class_features.T
    top = similarity.topk(max(ks), dim=1).indices
    hits = top == torch.as_tensor(list(labels)).unsqueeze(1)
    return {f"top{k}": 100.0 * hits[:, :k].any(dim=1).float().mean().item() for k in ks}
