"""open_clip models, tokenizers and transforms by name; clipforge never forks open_clip's code.

Bundled architectures (configs/*.json, e.g. `clipforge-tiny`) are registered through
open_clip's own config registry, so every open_clip function accepts their names. A Hugging
Face text tower is swapped in the same way: a derived config is registered under a new name.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import open_clip
import torch

from clipforge.fields import ConfigError
from clipforge.model.config import ModelConfig
from clipforge.model.files import ModelFilesError, weights_file
from clipforge.model.names import resolve_model_name
from clipforge.util import first_line


@dataclass
class ClipBundle:
    model: torch.nn.Module
    preprocess_train: Callable
    preprocess_val: Callable
    tokenizer: Callable
    model_cfg: dict  # the open_clip config the model was built from (exported with the weights)
    preprocess_cfg: dict


# SigLIP's start (its paper; open_clip_train's --siglip): temperature 10, bias -10.
SIGLIP_INIT = {"init_logit_scale": math.log(10), "init_logit_bias": -10.0}


def loss_init(name: str, loss: str) -> dict[str, float]:
    """The open_clip model arguments train.loss needs: none for CLIP's loss; for SigLIP's, the
    learned bias (the model then has a `logit_bias` parameter) and the starting temperature,
    each the model config's own where it sets one (open_clip's *-SigLIP configs set the bias).
    A model whose config sets the bias, under CLIP's loss, is refused: ClipLoss has no place for
    it."""
    own = open_clip.get_model_config(name) or {}
    if loss == "siglip":
        return {key: own.get(key, value) for key, value in SIGLIP_INIT.items()}
    if "init_logit_bias" in own:
        raise ConfigError(
            f"model.name: {name} is a SigLIP model (its config sets a learned bias), which "
            f"train.loss: {loss} has no place for; set train.loss: siglip, or another model.name"
        )
    return {}


def build_model(cfg: ModelConfig, loss: str = "clip") -> ClipBundle:
    """Create the model (random init, or weights from model.pretrained), transforms, tokenizer,
    for the loss `loss` (train.loss: `siglip` adds SigLIP's learned bias)."""
    name = resolve_model_name(cfg)
    init = loss_init(name, loss)
    kwargs: dict[str, Any] = {"output_dict": True, **init}
    if cfg.image_size:
        kwargs["force_image_size"] = cfg.image_size
    if cfg.patch_dropout:
        # open_clip's PatchDropout: active in train() mode only. Not in model_cfg below, so the
        # export is the plain architecture.
        kwargs["force_patch_dropout"] = cfg.patch_dropout
    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(name, **kwargs)
    if cfg.pretrained:
        load_pretrained(model, cfg.pretrained)
    flag_causal_text_attention(model)
    # the export's config builds the same parameters: plain open_clip loads SigLIP's bias too
    model_cfg = {**copy.deepcopy(open_clip.get_model_config(name)), **init}
    if cfg.image_size:
        model_cfg["vision_cfg"]["image_size"] = cfg.image_size
    preprocess_cfg = dict(model.visual.preprocess_cfg)
    return ClipBundle(
        model,
        preprocess_train,
        preprocess_val,
        open_clip.get_tokenizer(name),
        model_cfg,
        preprocess_cfg,
    )


class CausalFlagAttention(torch.nn.MultiheadAttention):
    """open_clip's text attention told that its mask is the causal one.

    open_clip passes the text tower an explicit 77x77 float mask, which keeps
    scaled_dot_product_attention off its flash and memory-efficient kernels. Given `is_causal`,
    torch drops that mask and asks the kernel for causal attention instead: the same result
    (tests/model/test_causal_attention.py), other kernels. A subclass with no state of its own:
    the parameters and the state dict are nn.MultiheadAttention's, so checkpoints and exports
    are unchanged and plain open_clip loads them."""

    def forward(self, query, key, value, *args, attn_mask=None, is_causal=False, **kwargs):
        return super().forward(
            query,
            key,
            value,
            *args,
            attn_mask=attn_mask,
            is_causal=is_causal or attn_mask is not None,
            **kwargs,
        )


def flag_causal_text_attention(model: torch.nn.Module) -> int:
    """Swap the text tower's attention layers for CausalFlagAttention where open_clip's own
    tower passes them exactly the causal mask; the number swapped (0: a tower this does not
    describe, e.g. Hugging Face's, or a bidirectional one)."""
    mask = getattr(model, "attn_mask", None)
    blocks = getattr(getattr(model, "transformer", None), "resblocks", [])
    if mask is None or not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        return 0
    causal = torch.full_like(mask, float("-inf")).triu_(1)
    if not torch.equal(mask, causal):
        return 0
    swapped = 0
    for block in blocks:
        if type(getattr(block, "attn", None)) is torch.nn.MultiheadAttention:
            block.attn.__class__ = CausalFlagAttention
            swapped += 1
    return swapped


def without_causal_flag(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` exactly as plain open_clip builds it (float-mask attention): the
    references that benchmarks compare clipforge against."""
    plain = copy.deepcopy(model)
    for module in plain.modules():
        if type(module) is CausalFlagAttention:
            cast(torch.nn.Module, module).__class__ = torch.nn.MultiheadAttention
    return plain


def load_pretrained(model: torch.nn.Module, source: str) -> None:
    """model.pretrained: `local-dir:PATH` of an export, or a weights file. CLIP weights start a
    SigLIP model too (open weights are mostly CLIP's): open_clip's load_checkpoint starts the
    bias they lack at 0 (its issue 712), beside their trained temperature."""
    load_weights(model, weights_file(source, "model.pretrained"), "model.pretrained")


def load_weights(model: torch.nn.Module, path: Path, what: str) -> None:
    """Every parameter of `model` from `path`, without executing code (safetensors, or
    torch.load(weights_only=True)); ModelFilesError naming the file otherwise. A damaged or
    partial file, or weights of another architecture, must never leave some parameters at their
    random initialisation."""
    # open_clip's load_checkpoint fails on it with an AttributeError about None
    if getattr(model, "logit_bias", None) is None and "logit_bias" in _safetensors_keys(path):
        raise ModelFilesError(
            f"{what}: {path} holds SigLIP's logit_bias, which a model for CLIP's loss has not: "
            f"set train.loss: siglip to go on with SigLIP's loss"
        )
    try:
        incompatible = open_clip.load_checkpoint(model, str(path), strict=False, weights_only=True)
    except Exception as exc:  # safetensors, zip, unpickling and shape errors: all a bad file here
        raise ModelFilesError(f"{what}: {path} cannot be loaded: {first_line(exc)}") from None
    missing, unexpected = incompatible.missing_keys, incompatible.unexpected_keys
    if missing or unexpected:
        raise ModelFilesError(
            f"{what}: {path} does not fit the model ({len(missing)} parameters missing"
            f"{_example(missing)}, {len(unexpected)} unexpected{_example(unexpected)}): a "
            f"partial file, or weights of another architecture"
        )


def _safetensors_keys(path: Path) -> set[str]:
    """The tensor names of a .safetensors file, read from its header (none for another format or
    a damaged file: load_weights reports those)."""
    from safetensors import safe_open

    if path.suffix != ".safetensors":
        return set()
    try:
        with safe_open(str(path), framework="pt") as f:
            return set(f.keys())
    except Exception:  # a damaged file: open_clip's own load below names what is wrong
        return set()


def _example(keys: list[str]) -> str:
    return f", e.g. {keys[0]}" if keys else ""
