"""Encoding a test set with a model and scoring it: no files written, nothing printed."""

from __future__ import annotations

import io
from collections.abc import Callable

from clipforge.data.testset import TestSet
from clipforge.eval.loading import load_model
from clipforge.metrics.retrieval import relevance_matrix, retrieval_metrics


def encode_images(model, preprocess: Callable, images: list[bytes], batch_size: int, device: str):
    import torch
    from PIL import Image

    from clipforge.data.samples import to_rgb

    chunks = []
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            batch = torch.stack(
                [
                    preprocess(to_rgb(Image.open(io.BytesIO(b))))
                    for b in images[start : start + batch_size]
                ]
            ).to(device)
            chunks.append(model.encode_image(batch, normalize=True).float().cpu())
    return torch.cat(chunks)


def encode_texts(model, tokenizer: Callable, texts: list[str], batch_size: int, device: str):
    import torch

    chunks = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            tokens = tokenizer(texts[start : start + batch_size]).to(device)
            chunks.append(model.encode_text(tokens, normalize=True).float().cpu())
    return torch.cat(chunks)


def evaluate(
    spec: str, pretrained: str | None, test_set: TestSet, batch_size: int, device: str, what: str
) -> tuple[dict, dict]:
    """(recall metrics, test set counts) of one model; `what` names it in errors (--model,
    eval.baseline_model)."""
    model, preprocess, tokenizer = load_model(spec, pretrained, device, what)
    image_features = encode_images(model, preprocess, test_set.images, batch_size, device)
    text_features = encode_texts(
        model, tokenizer, [t.text for t in test_set.texts], batch_size, device
    )
    relevant = relevance_matrix(test_set.image_ids, test_set.texts)
    counts = {
        "num_images": len(test_set.image_ids),
        "num_texts": len(test_set.texts),
        "num_i2t_queries": int(relevant.any(dim=0).sum()),  # images some caption describes
    }
    return retrieval_metrics(image_features, text_features, relevant), counts
