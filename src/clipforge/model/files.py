"""The files behind a model a stage is told to load, checked before anything heavy is imported.

open_clip builds a randomly initialised model, with one log line, when a `local-dir:` folder has no
weights file or an architecture name comes without pretrained weights; evaluated, such a model gives
a recall that looks like a result. Every stage that loads weights (eval's model and baseline, the
train stage's `model.pretrained`) checks here first that they exist; `clipforge.model.load_weights`
then checks that they fill the whole model. Standard library only: the stage shells call it
before importing torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from clipforge.errors import UserError

LOCAL_DIR = "local-dir:"
HF_HUB = "hf-hub:"
# A Chinese-CLIP model: the original repository's .pt checkpoint (with the vocab.txt of its
# tokenizer beside it), or the transformers form (a ChineseCLIPModel folder).
CHINESE_CLIP = "chinese-clip:"
CHINESE_CLIP_VOCAB = "vocab.txt"
CONFIG_FILE = "open_clip_config.json"
# What open_clip's own export (and clipforge's) writes, in the order open_clip prefers them.
WEIGHTS_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
_WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weights_included(model: str) -> bool:
    """Does a model spec bring its weights (`local-dir:`, `hf-hub:`, `chinese-clip:`)? A bare
    name is an open_clip architecture: without pretrained weights, a random model."""
    return model.startswith((LOCAL_DIR, HF_HUB, CHINESE_CLIP))


class ModelFilesError(UserError, ValueError):
    """A model folder or weights file that cannot give the model it names; the message says which
    file and what to do."""


def local_dir_weights(directory: Path, what: str) -> Path:
    """The weights file of an open_clip `local-dir:` export, after checking its config is there."""
    if not directory.is_dir():
        raise ModelFilesError(
            f"{what}: {directory}: no such directory; run the train stage first, or give the "
            f"folder of an exported model"
        )
    config = directory / CONFIG_FILE
    if not config.is_file():
        raise ModelFilesError(
            f"{what}: {config} not found: a local-dir model needs the architecture beside its "
            f"weights (copy the whole exported folder)"
        )
    try:
        ok = "model_cfg" in json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise ModelFilesError(f"{what}: {config} is not readable JSON ({exc})") from None
    if not ok:
        raise ModelFilesError(f"{what}: {config} has no `model_cfg`: not an open_clip export")
    found = [directory / name for name in WEIGHTS_FILES if (directory / name).is_file()]
    if not found:
        raise ModelFilesError(
            f"{what}: no weights in {directory}: expected {WEIGHTS_FILES[0]} (or "
            f"{WEIGHTS_FILES[1]}); without them the model would be randomly initialised"
        )
    return found[0]


def weights_file(source: str, what: str) -> Path:
    """The file `model.pretrained` names: `local-dir:PATH` of an export, or a weights file."""
    if source.startswith(LOCAL_DIR):
        return local_dir_weights(Path(source[len(LOCAL_DIR) :]), what)
    path = Path(source)
    if not path.is_file():
        raise ModelFilesError(
            f"{what}: {path} not found (a .safetensors, .pt or .bin file, or local-dir:PATH)"
        )
    return path


def check_model_weights(spec: str, pretrained: str | None, what: str) -> None:
    """An eval model (`local-dir:PATH`, `hf-hub:ORG/REPO` or an open_clip name with `pretrained`)
    has weights to load. hf-hub models and open_clip's tags are checked when open_clip fetches
    them."""
    if spec.startswith(LOCAL_DIR):
        local_dir_weights(Path(spec[len(LOCAL_DIR) :]), what)
    elif spec.startswith(CHINESE_CLIP):
        chinese_clip_files(Path(spec[len(CHINESE_CLIP) :]), what)
    elif spec.startswith(HF_HUB):
        return
    elif pretrained and looks_like_a_file(pretrained) and not Path(pretrained).is_file():
        raise ModelFilesError(f"{what}: pretrained weights {pretrained} not found")


def chinese_clip_files(path: Path, what: str) -> None:
    """A Chinese-CLIP model has its weights, tokenizer and (folder form) preprocessing: a .pt
    file with vocab.txt beside it, or a transformers ChineseCLIPModel folder."""
    if path.is_file():
        vocab = path.parent / CHINESE_CLIP_VOCAB
        if not vocab.is_file():
            raise ModelFilesError(
                f"{what}: {vocab} not found: a Chinese-CLIP checkpoint needs its tokenizer's "
                f"vocabulary beside it (Chinese-CLIP's repository: cn_clip/clip/vocab.txt)"
            )
        return
    if not path.is_dir():
        raise ModelFilesError(
            f"{what}: {path} not found (a Chinese-CLIP .pt checkpoint, or a transformers "
            f"ChineseCLIPModel folder)"
        )
    config = path / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as exc:
        raise ModelFilesError(f"{what}: {config} is not readable JSON ({exc})") from None
    if model_type != "chinese_clip":
        raise ModelFilesError(
            f"{what}: {config} is a {model_type!r} model, not a transformers ChineseCLIPModel"
        )
    expected = {
        "weights": ("model.safetensors", "pytorch_model.bin"),
        "tokenizer": (CHINESE_CLIP_VOCAB, "tokenizer.json"),
        "image preprocessing": ("preprocessor_config.json",),
    }
    for role, names in expected.items():
        if not any((path / name).is_file() for name in names):
            raise ModelFilesError(
                f"{what}: no {role} in {path}: expected {' or '.join(names)} (copy the whole "
                f"folder save_pretrained wrote, with the processor's files)"
            )


def looks_like_a_file(pretrained: str) -> bool:
    """A pretrained value that is a path rather than one of open_clip's tags (laion2b_s34b_b79k)."""
    return "/" in pretrained or pretrained.endswith(_WEIGHTS_SUFFIXES) or Path(pretrained).exists()
