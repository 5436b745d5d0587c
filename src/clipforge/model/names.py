"""What a model's name alone decides: whether open_clip knows it, its config and tokenizer.

What a model's name alone decides, without its weights or code: whether open_clip knows it, the
open_clip config it resolves to, and so its tokenizer and that tokenizer's fingerprint.

A home of its own so that the data stage can tokenise captions at data-prep time
(data.pretokenize_model) with exactly the tokenizer the train stage builds for that model,
without depending on the model's code (clipforge.model.factory) or weights. The fingerprint travels in
data/manifest.json; the train loader uses the stored ids only where the model's tokenizer has the
same one. The params check model names here (check_model_name), from the config files alone:
open_clip (which imports torch) is imported only to build.
"""

from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import importlib.util
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from clipforge.fields import ConfigError
from clipforge.util import short_repr

if TYPE_CHECKING:
    from clipforge.model.config import ModelConfig

BUNDLED_CONFIGS = Path(__file__).parent / "configs"
_registered = False


@functools.cache
def _config_files() -> dict[str, Path]:
    """name -> config file of every model open_clip can build: a file in its model_configs folder
    (open_clip names a model by its file's stem) or in clipforge's bundled ones. Read from the
    folders, without importing open_clip."""
    spec = importlib.util.find_spec("open_clip")
    places = (spec.submodule_search_locations or []) if spec else []
    folders = [*(Path(p) / "model_configs" for p in places), BUNDLED_CONFIGS]
    return {f.stem: f for folder in folders for f in sorted(folder.glob("*.json"))}


def known_model_names() -> list[str]:
    return sorted(_config_files())


def check_model_name(key: str, name: str | None) -> str | None:
    """`name` when open_clip can build it (or None: no model named); ConfigError naming `key`, the
    closest names and where the list is, otherwise (a knob's check: model.name,
    data.pretokenize_model)."""
    names = known_model_names()
    if name is None or name in names:
        return name
    by_lower = {n.lower(): n for n in names}
    close = [by_lower[name.lower()]] if name.lower() in by_lower else []
    close += [n for n in difflib.get_close_matches(name, names, n=3, cutoff=0.6) if n not in close]
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise ConfigError(
        f"{key}: unknown model {short_repr(name)}; {hint}open_clip knows {len(names)} models "
        f"(open_clip.list_models(), and clipforge's in src/clipforge/model/configs)"
    )


def register_bundled_configs() -> None:
    import open_clip

    global _registered
    if not _registered:
        open_clip.add_model_config(BUNDLED_CONFIGS)
        _registered = True


# The knobs that name a model (ModelConfig's), as errors name them; the data stage's own pair
# names the tokenizer of data.pretokenize_model.
MODEL_KEYS = ("model.name", "model.text_tower")


def resolve_model_name(cfg: ModelConfig, keys: tuple[str, str] = MODEL_KEYS) -> str:
    """The open_clip name to build: the configured one, or a derived one with an HF text tower.
    An HF tower (model.text_tower, or one in the named config such as xlm-roberta-base-ViT-B-32)
    is checked to be loadable first, with an error that says how to get it (text_towers.py).
    `keys`: the knobs that gave cfg's name and text tower, for the errors."""
    import open_clip

    register_bundled_configs()
    base = open_clip.get_model_config(cfg.name)
    if base is None:
        check_model_name(keys[0], cfg.name)  # raises, naming the closest
        raise ConfigError(f"{keys[0]}: {cfg.name}'s config file is not an open_clip model's")
    tower = _text_tower(cfg, keys, base)
    if tower is None:
        return cfg.name
    derived = copy.deepcopy(base)
    # Chinese-CLIP's text head: the [CLS] state through one bias-free linear layer. So the model
    # is that architecture (a transformers ChineseCLIPModel, clipforge.export.hf), not open_clip's
    # default two-layer MLP head.
    derived["text_cfg"] = {
        "hf_model_name": tower,
        "hf_tokenizer_name": tower,
        "hf_proj_type": "linear",
        "hf_pooler_type": "cls_last_hidden_state_pooler",
        "context_length": base.get("text_cfg", {}).get("context_length", 77),
    }
    assert cfg.text_tower is not None  # a tower came from it
    name = f"{cfg.name}--text-{re.sub(r'[^A-Za-z0-9]+', '-', cfg.text_tower).strip('-')}"
    # open_clip registers configs only from files; it keeps what it read, so the file can go.
    with tempfile.TemporaryDirectory(prefix="clipforge-model-config-") as directory:
        config_file = Path(directory) / f"{name}.json"
        config_file.write_text(json.dumps(derived))
        open_clip.add_model_config(config_file)
    return name


def check_text_tower(cfg: ModelConfig, keys: tuple[str, str] = MODEL_KEYS) -> None:
    """The Hugging Face text tower of a model of `cfg` checked to load, as resolve_model_name
    checks it, from the config file alone (no open_clip, no torch): a missing tower is one line
    before the training stack starts, not after DeepSpeed's start-up."""
    _text_tower(cfg, keys, _config_of(cfg.name))


def tower_kinds(cfg: ModelConfig) -> tuple[str, str]:
    """The (image, text) tower classes open_clip builds for a model of `cfg`, decided as its
    factory decides them, from the config file alone: image `vit` (VisionTransformer), `resnet`
    (ModifiedResNet) or `timm` (TimmModel); text `open_clip` (TextTransformer) or `hf`
    (HFTextEncoder: model.text_tower, or the config's own)."""
    config = _config_of(cfg.name)
    vision, text = config.get("vision_cfg", {}), config.get("text_cfg", {})
    if vision.get("timm_model_name"):
        image = "timm"
    elif isinstance(vision.get("layers"), (list, tuple)):
        image = "resnet"
    else:
        image = "vit"
    return image, "hf" if cfg.text_tower or text.get("hf_model_name") else "open_clip"


def _config_of(name: str) -> dict:
    return json.loads(_config_files()[name].read_text("utf-8"))


def _text_tower(cfg: ModelConfig, keys: tuple[str, str], base: dict) -> str | None:
    """model.text_tower resolved (a folder: its absolute path), None without; either that or a
    tower the named config `base` has is checked to load (ConfigError naming its key)."""
    from clipforge.model.text_towers import resolve_tower

    name_key, tower_key = keys
    if cfg.text_tower:
        return resolve_tower(cfg.text_tower, tower_key)
    builtin_tower = base.get("text_cfg", {}).get("hf_model_name")
    if builtin_tower:
        resolve_tower(builtin_tower, name_key)
    return None


def model_tokenizer(cfg: ModelConfig, keys: tuple[str, str] = MODEL_KEYS) -> Callable:
    """The tokenizer clipforge.model.build_model gives a model of `cfg`: open_clip's for the
    resolved name (an HF tower's own, at the base model's context length)."""
    import open_clip

    return open_clip.get_tokenizer(resolve_model_name(cfg, keys))


# Texts whose ids stand for a tokenizer's behaviour beyond its vocabulary: normalisation (case,
# whitespace, ftfy's fixes), special tokens, truncation at the context length, padding.
_PROBE_TEXTS = [
    "左上角有一个红色的圆形，中间有一个绿色的三角形",
    "A Photo of TWO cats, on the mat!",
    "  多个   空格\t和\n换行  ",
    "caf\u00e9 &amp; na\u00efve \u00e2\u20ac\u0153mojibake\u00e2\u20ac\u009d",
    "\U0001f642 全角：“引号”（括号）。１２３",
    "长" * 300,
]


def tokenizer_fingerprint(tokenizer: Callable) -> dict | None:
    """What ids a tokenizer gives, in a few numbers: its class, context length, vocabulary (size,
    largest id, sha256 of token -> id) and the sha256 of its ids for fixed probe texts. None for
    a tokenizer whose vocabulary this cannot read (then no ids are stored or trusted)."""
    import numpy as np

    inner = getattr(tokenizer, "tokenizer", None)  # open_clip's HFTokenizer wraps transformers'
    vocab = inner.get_vocab() if inner is not None else getattr(tokenizer, "encoder", None)
    context_length = getattr(tokenizer, "context_length", None)
    if not isinstance(vocab, dict) or not vocab or not isinstance(context_length, int):
        return None
    kind = type(tokenizer).__name__ + (f"({type(inner).__name__})" if inner is not None else "")
    ordered = json.dumps(sorted(vocab.items(), key=lambda item: item[1]), ensure_ascii=False)
    probe = np.ascontiguousarray(np.asarray(tokenizer(_PROBE_TEXTS)), dtype="<i8")
    return {
        "class": kind,
        "context_length": context_length,
        "vocab_size": len(vocab),
        "max_id": int(max(vocab.values())),
        "vocab_sha256": hashlib.sha256(ordered.encode("utf-8")).hexdigest(),
        "probe_sha256": hashlib.sha256(probe.tobytes()).hexdigest(),
    }


def fingerprint_difference(stored: dict, current: dict | None) -> str | None:
    """What tells two tokenizer fingerprints apart, in words (None: the same tokenizer)."""
    if current is None:
        return "the model's tokenizer has no fingerprint (its vocabulary cannot be read)"
    for key in ("class", "context_length", "vocab_size", "max_id", "vocab_sha256", "probe_sha256"):
        if stored.get(key) != current.get(key):
            what = key.replace("_sha256", "").replace("_", " ")
            if key.endswith("sha256"):
                return f"another {what} (sha256 {str(stored.get(key))[:12]} vs {current[key][:12]})"
            return f"{what} {stored.get(key)} vs the model's {current[key]}"
    return None
