"""Hugging Face text towers: where one comes from, and a clear error when it cannot be had.

open_clip builds an HF text tower (`text_cfg.hf_model_name`, e.g. `hfl/chinese-roberta-wwm-ext`
or open_clip's own `xlm-roberta-base-ViT-B-32`) with transformers' AutoConfig/AutoModel/
AutoTokenizer, which read a local folder or the Hugging Face hub (through its cache). On a GPU
host without network, a tower that was never downloaded fails deep inside transformers; this
module checks first and says what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

from clipforge.fields import ConfigError
from clipforge.util import first_line, short_repr

_PATH_PREFIXES = ("/", "./", "../", "~")


def resolve_tower(name: str, key: str) -> str:
    """A local folder -> its absolute path (so the exported config still finds it after a cd);
    a hub id -> itself, once its config and tokenizer are known to load. ConfigError otherwise,
    naming the params key `key`."""
    try:
        import transformers  # noqa: F401 - only to fail early with the right advice
    except ImportError:
        raise ConfigError(
            f"{key}: {short_repr(name)} is a Hugging Face text tower, which needs the "
            f"`transformers` package: pip install -e '.[hf]'"
        ) from None
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{key}: {path} has no config.json; expected a Hugging Face model "
                f"folder (config.json, weights, tokenizer files)"
            )
        return str(path.resolve())
    if name.startswith(_PATH_PREFIXES):
        raise ConfigError(f"{key}: folder {path} not found")
    check_hub_tower(name, key)
    return name


def check_hub_tower(repo_id: str, key: str) -> None:
    """Load the config and tokenizer of a hub model (from the cache when offline)."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        AutoConfig.from_pretrained(repo_id)
        AutoTokenizer.from_pretrained(repo_id)
    except (OSError, ValueError) as exc:
        raise ConfigError(unavailable_message(repo_id, key, exc)) from None


def unavailable_message(repo_id: str, key: str, exc: Exception) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get(
        "TRANSFORMERS_OFFLINE", ""
    ) not in ("", "0")
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
    )
    why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
    return (
        f"{key}: Hugging Face model {short_repr(repo_id)} is not in the local cache ({cache}) and "
        f"{why}. Download it once where there is network (`hf download {repo_id}`, then copy "
        f"the cache or set HF_HOME), or point {key} at a local folder with config.json, the "
        f"weights and the tokenizer files. ({first_line(exc)})"
    )
