"""Encoding a suite with a model and scoring it: no files written, nothing printed.

Each image of a suite is decoded, preprocessed and encoded once per model, in batches on the
device; a thread decodes and preprocesses the next batch while the model encodes this one
(Pillow releases the GIL while it decodes and resizes). Measured in BENCHMARKS.md (eval).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clipforge.data.testset import ClassificationSet, TestSetError
from clipforge.eval.suites import Suite
from clipforge.export.loading import load_model
from clipforge.metrics.classification import class_embeddings, zero_shot_accuracy
from clipforge.metrics.retrieval import relevance_matrix, retrieval_metrics


def _pixels(preprocess: Callable, image: bytes | Path):
    from PIL import Image

    from clipforge.data.samples import to_rgb

    try:
        with Image.open(io.BytesIO(image) if isinstance(image, bytes) else image) as decoded:
            return preprocess(to_rgb(decoded))
    except OSError as exc:  # a classification image is checked by its header only (testset)
        if isinstance(image, bytes):
            raise  # a retrieval set's images were decoded when it was loaded: a bug
        raise TestSetError([f"{image}: cannot be decoded ({exc})"]) from None


def _batches(preprocess: Callable, images: Sequence[bytes | Path], batch_size: int) -> Iterator:
    """Stacked pixel batches, the next one prepared on a thread while this one is encoded."""
    import torch

    def batch(start: int):
        return torch.stack([_pixels(preprocess, i) for i in images[start : start + batch_size]])

    starts = range(0, len(images), batch_size)
    if not starts:
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(batch, starts[0])
        for following in starts[1:]:
            ready = pending.result()
            pending = pool.submit(batch, following)
            yield ready
        yield pending.result()


def _no_beat() -> None:
    pass


def encode_images(
    model,
    preprocess: Callable,
    images: Sequence[bytes | Path],
    batch_size: int,
    device: str,
    beat: Callable[[], None] = _no_beat,
):
    """L2-normalised image features [images, d] on the CPU, in the order of `images` (encoded
    image files, or paths of them). `beat` is called per batch: progress, for a hang watchdog."""
    import torch

    chunks = []
    with torch.no_grad():
        for pixels in _batches(preprocess, images, batch_size):
            chunks.append(model.encode_image(pixels.to(device), normalize=True).float().cpu())
            beat()
    return torch.cat(chunks)


def encode_texts(
    model,
    tokenizer: Callable,
    texts: list[str],
    batch_size: int,
    device: str,
    beat: Callable[[], None] = _no_beat,
):
    import torch

    chunks = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            tokens = tokenizer(texts[start : start + batch_size]).to(device)
            chunks.append(model.encode_text(tokens, normalize=True).float().cpu())
            beat()
    return torch.cat(chunks)


def prompts(class_names: list[str], templates: Sequence[str]) -> list[str]:
    """Every template filled with every class name, class-major (class_embeddings' order)."""
    return [template.replace("{}", name) for name in class_names for template in templates]


def score_suite(
    model,
    preprocess,
    tokenizer,
    suite: Suite,
    batch_size: int,
    device: str,
    beat: Callable[[], None] = _no_beat,
) -> dict:
    """The suite's metrics: recall (retrieval) or top-1/top-5 accuracy (classification)."""
    data = suite.data
    if isinstance(data, ClassificationSet):
        image_features = encode_images(model, preprocess, data.images, batch_size, device, beat)
        prompt_features = encode_texts(
            model, tokenizer, prompts(data.class_names, suite.templates), batch_size, device, beat
        )
        classes = class_embeddings(prompt_features, len(suite.templates))
        return zero_shot_accuracy(image_features, classes, data.labels)
    image_features = encode_images(model, preprocess, data.images, batch_size, device, beat)
    texts = [t.text for t in data.texts]
    text_features = encode_texts(model, tokenizer, texts, batch_size, device, beat)
    relevant = relevance_matrix(data.image_ids, data.texts)
    return retrieval_metrics(image_features, text_features, relevant, suite.config.directions)


def evaluate(
    spec: str,
    pretrained: str | None,
    suites: list[Suite],
    batch_size: int,
    device: str,
    what: str,
    beat: Callable[[], None] = _no_beat,
) -> dict[str, dict]:
    """{suite name: metrics} of one model, loaded once; `what` names it in errors (--model,
    eval.baseline_model); `beat` is called per batch encoded."""
    model, preprocess, tokenizer = load_model(spec, pretrained, device, what)
    return {
        suite.name: score_suite(model, preprocess, tokenizer, suite, batch_size, device, beat)
        for suite in suites
    }
