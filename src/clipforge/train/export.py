"""The trained model in open_clip's `local-dir:` layout, loadable without clipforge:

model, _, preprocess = open_clip.create_model_and_transforms("local-dir:models/clip")
tokenizer = open_clip.get_tokenizer("local-dir:models/clip")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from clipforge.fsutil import replace_dir_atomically
from clipforge.model_files import CONFIG_FILE, WEIGHTS_FILES

WEIGHTS_FILE = WEIGHTS_FILES[0]


def export_model(
    state_dict: dict[str, torch.Tensor],
    model_cfg: dict,
    preprocess_cfg: dict,
    config_yaml: str,
    out: Path,
    tokenizer=None,
) -> None:
    """tokenizer: a Hugging Face one (open_clip's HFTokenizer) is saved into the folder, where
    `open_clip.get_tokenizer("local-dir:...")` looks for it; open_clip's own needs no files."""
    from safetensors.torch import save_file

    open_clip_config = {"model_cfg": model_cfg, "preprocess_cfg": _jsonable(preprocess_cfg)}
    with replace_dir_atomically(out) as tmp:
        save_file(state_dict, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(open_clip_config, indent=2) + "\n", "utf-8")
        (tmp / "clipforge_config.yaml").write_text(config_yaml, encoding="utf-8")
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)


def _jsonable(cfg: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}
