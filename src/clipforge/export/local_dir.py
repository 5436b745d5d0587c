"""The trained model in open_clip's `local-dir:` layout, loadable without clipforge.

It loads so:

model, _, preprocess = open_clip.create_model_and_transforms("local-dir:models/clip")
tokenizer = open_clip.get_tokenizer("local-dir:models/clip")

and, in its `transformers/` folder, the same model for Hugging Face transformers where a class
computes it (clipforge.export.hf), with a model card (README.md) in both.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from clipforge.export.card import CARD_FILE, TRANSFORMERS_DIR, CardFacts, render
from clipforge.fsutil import give_default_modes, replace_dir_atomically
from clipforge.model.files import CONFIG_FILE, WEIGHTS_FILES

WEIGHTS_FILE = WEIGHTS_FILES[0]

log = logging.getLogger(__name__)


def export_model(
    state_dict: dict[str, torch.Tensor],
    model_cfg: dict,
    preprocess_cfg: dict,
    config_yaml: str,
    out: Path,
    tokenizer=None,
    card: CardFacts | None = None,
) -> str | None:
    """tokenizer: a Hugging Face one (open_clip's HFTokenizer) is saved into the folder, where
    `open_clip.get_tokenizer("local-dir:...")` looks for it; open_clip's own needs no files.
    Returns the transformers class of the transformers folder, None where there is none."""
    from safetensors.torch import save_file

    open_clip_config = {"model_cfg": model_cfg, "preprocess_cfg": _jsonable(preprocess_cfg)}
    with replace_dir_atomically(out) as tmp:
        save_file(state_dict, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(open_clip_config, indent=2) + "\n", "utf-8")
        (tmp / "clipforge_config.yaml").write_text(config_yaml, encoding="utf-8")
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        kind, skipped = _transformers_export(
            state_dict, model_cfg, preprocess_cfg, tmp / TRANSFORMERS_DIR, tokenizer
        )
        if card is not None:
            (tmp / CARD_FILE).write_text(render(card, kind, skipped), encoding="utf-8")
            if kind:
                (tmp / TRANSFORMERS_DIR / CARD_FILE).write_text(
                    render(card, kind, skipped, in_transformers_folder=True), encoding="utf-8"
                )
        give_default_modes(tmp)  # safetensors writes its files 0600, the rest get the umask's
    return kind


def _transformers_export(state_dict, model_cfg, preprocess_cfg, out, tokenizer):
    """(class, "") once written; (None, why) for a model transformers cannot hold, or no
    transformers installed (the `hf` extra): a skipped export is one log line, never a failed
    run whose open_clip export is already there."""
    try:
        import transformers  # noqa: F401 - optional: the `hf` extra
    except ImportError:
        why = "the transformers package is not installed (pip install 'clipforge[hf]')"
        log.warning("no transformers export: %s", why)
        return None, why
    from clipforge.export.hf import NotRepresentable, export_hf

    try:
        return export_hf(state_dict, model_cfg, preprocess_cfg, out, tokenizer), ""
    except NotRepresentable as exc:
        log.warning("no transformers export: %s", exc)
        return None, str(exc)


def _jsonable(cfg: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}
