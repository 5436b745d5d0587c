"""A model to evaluate, loaded through plain open_clip as a user would load it."""

from __future__ import annotations

import logging
from pathlib import Path

from clipforge.cli import StageError
from clipforge.model_files import LOCAL_DIR, local_dir_weights, looks_like_a_file


def load_open_clip(spec: str, pretrained: str | None, device: str, what: str | None = None):
    """(model, preprocess, tokenizer) through plain open_clip, as a user would, except that the
    weights must fill the whole model (clipforge.model.load_weights): open_clip alone would
    evaluate a randomly initialised model when a folder has no weights file. Weights that cannot
    be had (no network and not cached, an unknown tag) are a StageError in one line."""
    import open_clip

    from clipforge.model import load_weights, register_bundled_configs

    register_bundled_configs()
    what = what or spec
    if spec.startswith(LOCAL_DIR):
        weights = local_dir_weights(Path(spec[len(LOCAL_DIR) :]), what)
    elif pretrained and looks_like_a_file(pretrained):
        weights = Path(pretrained)
    else:  # hf-hub:, or an open_clip tag open_clip downloads: a failed download is an error
        weights = None
    # The hub logs every retry of a failed download (twice: through its handler and the root
    # one), open_clip logs the failure again before raising it: the failure is reported once,
    # below.
    logging.disable(logging.ERROR)
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(
            spec,
            pretrained=None if weights else pretrained,
            load_weights=weights is None,
            pretrained_text=weights is None,  # an HF text tower's own weights: replaced anyway
            require_pretrained=weights is None,
            device=device,
        )
    except (RuntimeError, OSError) as exc:
        raise StageError(_weights_error(spec, pretrained, exc)) from None
    finally:
        logging.disable(logging.NOTSET)
    if weights:
        load_weights(model, weights, what)
    model.eval()
    return model, preprocess, open_clip.get_tokenizer(spec)


def _weights_error(spec: str, pretrained: str | None, exc: Exception) -> str:
    what = f"{spec}" + (f" with pretrained {pretrained}" if pretrained else "")
    reason = " ".join(str(exc).split())
    if "download" in reason.lower() or "offline" in reason.lower():
        return (
            f"{what}: the weights are not in the local cache (HF_HOME) and could not be "
            f"downloaded (no network?): run once where the Hugging Face hub is reachable, or "
            f"give a weights file as pretrained"
        )
    return f"{what}: cannot load the weights: {reason[:300]}"


def tags_text(name: str) -> str:
    """The pretrained tags open_clip knows for an architecture, for an error message."""
    import open_clip

    tags = open_clip.list_pretrained_tags_by_model(name)
    return f"tags for {name}: {', '.join(tags)}" if tags else f"open_clip has no tags for {name}"
