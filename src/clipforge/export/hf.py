"""open_clip models as Hugging Face transformers folders, and Chinese-CLIP checkpoints as models.

transformers computes two CLIP families exactly as open_clip and Chinese-CLIP do:
- `CLIPModel`: OpenAI's architecture, open_clip's plain ViT + text transformer (ViT-B-32, the
  demo's clipforge-tiny), tokenised with open_clip's own BPE vocabulary (bundled with open_clip,
  written here as vocab.json + merges.txt: no download);
- `ChineseCLIPModel`: the same ViT with a BERT text tower read at its [CLS] token through one
  bias-free linear projection: the `production-zh-roberta` recipe, and Chinese-CLIP's own
  checkpoints (the original repository's .pt layout).
Anything else (layer scale, attentional pooling, timm or ResNet towers, an MLP text
projection...) is NotRepresentable, naming every config key in the way; nothing is written.
A model trained with SigLIP's loss (train.loss: siglip) is refused with SigLIP's reason: its
learned bias is part of its logits, and only `SiglipModel` has one, whose towers are not
open_clip's CLIP towers (and open_clip's own timm SigLIP towers are not converted here).

The weights move by name only (q/k/v split from open_clip's packed in-projection, projections
transposed): a load with strict=True proves every parameter found its place.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import torch

from clipforge.errors import UserError

log = logging.getLogger("clipforge.export")

CLIP = "CLIPModel"
CHINESE_CLIP = "ChineseCLIPModel"
# The tokens open_clip's BPE tokenizer reserves (its last two ids), by the names transformers uses.
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
CLIP_VOCAB_SIZE = 49408
# Chinese-CLIP's text context (its repository's default, and what its published numbers used).
CHINESE_CLIP_CONTEXT = 52
# What open_clip's LayerNorms use (torch's default); transformers' CLIP defaults to it too.
OPEN_CLIP_LN_EPS = 1e-5
_RESAMPLE = {"bicubic": 3, "bilinear": 2, "nearest": 0}  # PIL's codes, which transformers takes
# open_clip vision/text config keys this conversion maps; any other key set away from its
# default changes what the tower computes.
_VISION_MAPPED = {"layers", "width", "head_width", "mlp_ratio", "patch_size", "image_size"}
_VISION_TRAIN_ONLY = {"patch_dropout"}  # active in train() mode only: the export is unaffected
_TEXT_MAPPED = {"context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio"}
_HF_TEXT_MAPPED = {"hf_model_name", "hf_tokenizer_name", "hf_proj_type", "hf_pooler_type"}
_HF_TEXT_IGNORED = {"context_length", "hf_model_pretrained", "vocab_size", "width", "heads"}
_TOP_MAPPED = {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "custom_text"}


class NotRepresentable(UserError):
    """An open_clip model that no transformers class computes exactly; the message names what."""


def hf_class(model_cfg: dict) -> str:
    """CLIP or CHINESE_CLIP: the transformers class that computes this open_clip architecture;
    NotRepresentable naming every key that no class computes."""
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    if model_cfg.get("init_logit_bias") is not None:
        raise NotRepresentable(_siglip_refusal(model_cfg))
    vision, text = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    problems = [f"{key}={model_cfg[key]!r}" for key in model_cfg if key not in _TOP_MAPPED]
    if not isinstance(vision.get("layers", 12), int):
        problems.append(f"vision_cfg.layers={vision['layers']!r} (a ResNet image tower)")
    size = vision.get("image_size", 224)
    if isinstance(size, (list, tuple)) and len(set(size)) != 1:
        problems.append(f"vision_cfg.image_size={size!r} (not square)")
    problems += _changed(vision, CLIPVisionCfg, _VISION_MAPPED | _VISION_TRAIN_ONLY, "vision_cfg")
    if text.get("hf_model_name"):
        kind = CHINESE_CLIP
        if text.get("hf_proj_type", "mlp") != "linear":
            problems.append(
                f"text_cfg.hf_proj_type={text.get('hf_proj_type', 'mlp')!r} "
                f"(ChineseCLIPModel projects with one linear layer)"
            )
        if text.get("hf_pooler_type") != "cls_last_hidden_state_pooler":
            problems.append(
                f"text_cfg.hf_pooler_type={text.get('hf_pooler_type')!r} (ChineseCLIPModel "
                f"reads the [CLS] token's last hidden state)"
            )
        if text.get("hf_tokenizer_name", text["hf_model_name"]) != text["hf_model_name"]:
            problems.append(f"text_cfg.hf_tokenizer_name={text['hf_tokenizer_name']!r}")
        problems += _changed(text, CLIPTextCfg, _HF_TEXT_MAPPED | _HF_TEXT_IGNORED, "text_cfg")
    else:
        kind = CLIP
        if text.get("vocab_size", CLIP_VOCAB_SIZE) != CLIP_VOCAB_SIZE:
            problems.append(
                f"text_cfg.vocab_size={text['vocab_size']} (CLIPTokenizer here is open_clip's "
                f"{CLIP_VOCAB_SIZE}-token BPE)"
            )
        problems += _changed(text, CLIPTextCfg, _TEXT_MAPPED, "text_cfg")
    if problems:
        raise NotRepresentable(
            f"no transformers class computes this open_clip model: {', '.join(problems)}"
        )
    return kind


def _siglip_refusal(model_cfg: dict) -> str:
    """Why no transformers class computes a model with SigLIP's learned bias: CLIPModel and
    ChineseCLIPModel have no bias in their logits (an export would drop it: sigmoid(logits)
    would be wrong); SiglipModel has it, with SigLIP's own towers."""
    why = (
        f"no transformers class computes this open_clip model: "
        f"init_logit_bias={model_cfg['init_logit_bias']!r} (SigLIP's learned bias, which "
        f"CLIPModel and ChineseCLIPModel lack; SiglipModel has it, but "
    )
    if model_cfg.get("vision_cfg", {}).get("timm_model_name"):
        return why + "open_clip's timm SigLIP towers are not converted to it here)"
    return why + (
        "its towers are not open_clip's CLIP towers: its ViT has no class token and pools with "
        "an attention head, its text transformer is bidirectional and read at the last token)"
    )


def _changed(cfg: dict, defaults_class: type, mapped: set[str], section: str) -> list[str]:
    defaults = {f.name: f.default for f in dataclasses.fields(defaults_class)}
    return [
        f"{section}.{key}={value!r}"
        for key, value in cfg.items()
        if key not in mapped and (key not in defaults or defaults[key] != value)
    ]


def check_preprocess(preprocess_cfg: dict) -> None:
    """The image preprocessing a transformers image processor repeats: a shortest-side resize and
    a centre crop, or a squash to the square; the interpolations PIL has."""
    problems = []
    if preprocess_cfg.get("resize_mode", "shortest") not in ("shortest", "squash"):
        problems.append(f"resize_mode={preprocess_cfg['resize_mode']!r}")
    if preprocess_cfg.get("interpolation", "bicubic") not in _RESAMPLE:
        problems.append(f"interpolation={preprocess_cfg['interpolation']!r}")
    if problems:
        raise NotRepresentable(
            f"no transformers image processor repeats this preprocessing: {', '.join(problems)}"
        )


def export_hf(
    state_dict: dict[str, torch.Tensor],
    model_cfg: dict,
    preprocess_cfg: dict,
    out: Path,
    tokenizer: Any = None,
) -> str:
    """Write the transformers folder `out` (model, config, processor); returns the class name.
    NotRepresentable, with nothing written, for an architecture no class computes. tokenizer:
    open_clip's HFTokenizer of a BERT text tower (its files go into the folder)."""
    kind = hf_class(model_cfg)
    check_preprocess(preprocess_cfg)
    if kind == CLIP:
        model = clip_model(model_cfg)
        model.load_state_dict(open_clip_to_clip(state_dict), strict=True)
        processor = clip_processor(model_cfg, preprocess_cfg)
    else:
        model = chinese_clip_model(model_cfg)
        model.load_state_dict(open_clip_to_chinese_clip(state_dict), strict=True)
        processor = chinese_clip_processor(model_cfg, preprocess_cfg, tokenizer)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return kind


# --- configurations ---------------------------------------------------------------------------


def _side(size: Any) -> int:
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def vision_config(model_cfg: dict) -> dict:
    """transformers' CLIPVisionConfig arguments of an open_clip ViT (also ChineseCLIP's)."""
    vision = model_cfg["vision_cfg"]
    width = vision.get("width", 768)
    return {
        "hidden_size": width,
        "intermediate_size": int(width * vision.get("mlp_ratio", 4.0)),
        "num_hidden_layers": vision.get("layers", 12),
        "num_attention_heads": width // vision.get("head_width", 64),
        "image_size": _side(vision.get("image_size", 224)),
        "patch_size": vision.get("patch_size", 16),
        "hidden_act": "quick_gelu" if model_cfg.get("quick_gelu") else "gelu",
        "layer_norm_eps": OPEN_CLIP_LN_EPS,
        "projection_dim": model_cfg["embed_dim"],
    }


def clip_model(model_cfg: dict):
    from transformers import CLIPConfig, CLIPModel

    text = model_cfg["text_cfg"]
    width = text.get("width", 512)
    text_config = {
        "vocab_size": CLIP_VOCAB_SIZE,
        "hidden_size": width,
        "intermediate_size": int(width * text.get("mlp_ratio", 4.0)),
        "num_hidden_layers": text.get("layers", 12),
        "num_attention_heads": text.get("heads", 8),
        "max_position_embeddings": text.get("context_length", 77),
        "hidden_act": "quick_gelu" if model_cfg.get("quick_gelu") else "gelu",
        "layer_norm_eps": OPEN_CLIP_LN_EPS,
        "projection_dim": model_cfg["embed_dim"],
        # open_clip pools at the end-of-text token and pads with id 0; transformers pools at the
        # first eos_token_id (not at argmax, which it does only for the legacy eos id 2)
        "bos_token_id": CLIP_VOCAB_SIZE - 2,
        "eos_token_id": CLIP_VOCAB_SIZE - 1,
        "pad_token_id": 0,
    }
    config = CLIPConfig(
        text_config=text_config,
        vision_config=vision_config(model_cfg),
        projection_dim=model_cfg["embed_dim"],
    )
    return CLIPModel(config).eval()


def chinese_clip_model(model_cfg: dict):
    """ChineseCLIPModel of open_clip's ViT + BERT tower (the tower's config.json is read from
    where the train stage found it: a local folder, or the Hugging Face cache)."""
    from transformers import AutoConfig

    tower = AutoConfig.from_pretrained(model_cfg["text_cfg"]["hf_model_name"])
    if tower.model_type != "bert":
        raise NotRepresentable(
            f"no transformers class computes this open_clip model: its text tower is "
            f"{tower.model_type!r}, ChineseCLIPModel's is BERT"
        )
    return _chinese_clip(tower.to_dict(), vision_config(model_cfg), model_cfg["embed_dim"])


def _chinese_clip(text_config: dict, vision: dict, embed_dim: int):
    from transformers import ChineseCLIPConfig, ChineseCLIPModel, ChineseCLIPTextConfig

    text_keys = set(ChineseCLIPTextConfig().to_dict())
    text = {k: v for k, v in text_config.items() if k in text_keys and k != "model_type"}
    config = ChineseCLIPConfig(text_config=text, vision_config=vision, projection_dim=embed_dim)
    return ChineseCLIPModel(config).eval()


# --- processors -------------------------------------------------------------------------------


def image_processor_args(preprocess_cfg: dict) -> dict:
    """A transformers image processor's arguments that repeat open_clip's eval preprocessing."""
    side = _side(preprocess_cfg["size"])
    squash = preprocess_cfg.get("resize_mode", "shortest") == "squash"
    return {
        "do_resize": True,
        "size": {"height": side, "width": side} if squash else {"shortest_edge": side},
        "resample": _RESAMPLE[preprocess_cfg.get("interpolation", "bicubic")],
        "do_center_crop": not squash,
        "crop_size": {"height": side, "width": side},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(preprocess_cfg["mean"]),
        "image_std": list(preprocess_cfg["std"]),
        "do_convert_rgb": True,
    }


def clip_processor(model_cfg: dict, preprocess_cfg: dict):
    """CLIPProcessor: open_clip's BPE tokenizer (padded with id 0, as open_clip pads, like LAION's
    own transformers exports) and its image preprocessing."""
    import tempfile

    from transformers import CLIPImageProcessor, CLIPProcessor, CLIPTokenizerFast

    with tempfile.TemporaryDirectory(prefix="clipforge-clip-tokenizer-") as directory:
        vocab, merges = write_clip_vocab(Path(directory))
        tokenizer = CLIPTokenizerFast(
            vocab_file=str(vocab),
            merges_file=str(merges),
            bos_token=BOS,
            eos_token=EOS,
            unk_token=EOS,
            pad_token="!",
            model_max_length=model_cfg["text_cfg"].get("context_length", 77),
        )
    prepend_ftfy(tokenizer)
    return CLIPProcessor(
        image_processor=CLIPImageProcessor(**image_processor_args(preprocess_cfg)),
        tokenizer=tokenizer,
    )


def prepend_ftfy(tokenizer) -> None:
    """Make a fast tokenizer's normalizer start with what ftfy.fix_text, which open_clip runs on
    every text before its tokenizer (its own BPE, or a Hugging Face one), does to ordinary
    captions: full-width forms to ASCII (Chinese punctuation: "，" is ","), curly quotes
    straightened, Latin ligatures split. Without it, the ids of most Chinese captions differ
    from those the model was trained on. (ftfy's mojibake repair and open_clip's HTML
    unescaping are not repeated.)"""
    from ftfy import chardata
    from tokenizers import Regex, normalizers

    table = {**chardata.WIDTH_MAP, **chardata.LIGATURES}
    steps = [
        *(normalizers.Replace(chr(code), text) for code, text in sorted(table.items())),
        normalizers.Replace(Regex(chardata.SINGLE_QUOTE_RE.pattern), "'"),
        normalizers.Replace(Regex(chardata.DOUBLE_QUOTE_RE.pattern), '"'),
    ]
    backend = tokenizer.backend_tokenizer
    backend.normalizer = normalizers.Sequence(
        [*steps, *([backend.normalizer] if backend.normalizer else [])]
    )


def write_clip_vocab(directory: Path) -> tuple[Path, Path]:
    """vocab.json and merges.txt of open_clip's bundled BPE (its SimpleTokenizer's own tables)."""
    import json

    from open_clip.tokenizer import SimpleTokenizer

    bpe = SimpleTokenizer()
    specials = {"<start_of_text>": BOS, "<end_of_text>": EOS}
    vocab = {specials.get(token, token): index for token, index in bpe.encoder.items()}
    merges = sorted(bpe.bpe_ranks, key=bpe.bpe_ranks.__getitem__)
    vocab_file, merges_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_file.write_text(
        "#version: 0.2\n" + "\n".join(" ".join(pair) for pair in merges) + "\n", encoding="utf-8"
    )
    return vocab_file, merges_file


def chinese_clip_processor(model_cfg: dict, preprocess_cfg: dict, tokenizer: Any):
    """ChineseCLIPProcessor: the text tower's own tokenizer (open_clip's HFTokenizer wraps it),
    told open_clip's context length, and open_clip's image preprocessing."""
    from transformers import ChineseCLIPImageProcessor, ChineseCLIPProcessor

    if getattr(tokenizer, "tokenizer", None) is None:
        raise ValueError("a BERT text tower's export needs its tokenizer (open_clip HFTokenizer)")
    hf_tokenizer = copy.deepcopy(tokenizer.tokenizer)  # the training run's own stays as it is
    hf_tokenizer.model_max_length = model_cfg["text_cfg"].get("context_length", 77)
    if hf_tokenizer.is_fast:  # AutoTokenizer's choice for BERT; a slow one has no normalizer
        prepend_ftfy(hf_tokenizer)
    image = image_processor_args(preprocess_cfg)
    # ChineseCLIPImageProcessor can only resize to a given height and width (it has no
    # shortest-edge resize, whatever its defaults say): Chinese-CLIP's own squash to the square.
    # On square images, open_clip's resize + centre crop gives the same pixels; on others the
    # two differ (docs/pipeline.md says so).
    image["size"] = dict(image["crop_size"])
    return ChineseCLIPProcessor(
        image_processor=ChineseCLIPImageProcessor(**image), tokenizer=hf_tokenizer
    )


# --- weights ----------------------------------------------------------------------------------

_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}


def _blocks(state_dict: dict, source: str, target: str) -> dict[str, torch.Tensor]:
    """OpenAI-style residual blocks (`source`N.ln_1... with a packed q/k/v in-projection) in
    transformers' CLIP encoder naming under `target`."""
    out = {}
    pattern = re.compile(re.escape(source) + r"(\d+)\.(.+)\.(weight|bias)$")
    for key, value in state_dict.items():
        match = pattern.match(key)
        if not match:
            continue
        index, name, kind = match.groups()
        if name in _BLOCK:  # attn.in_proj_weight/bias do not match: they are split below
            out[f"{target}{index}.{_BLOCK[name]}.{kind}"] = value
        else:
            raise ValueError(f"unexpected parameter {key} in an OpenAI-style block")
    packed = re.compile(re.escape(source) + r"(\d+)\.attn\.in_proj_(weight|bias)$")
    for key, value in state_dict.items():
        match = packed.match(key)
        if match:
            index, kind = match.groups()
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                out[f"{target}{index}.self_attn.{part}.{kind}"] = chunk.contiguous()
    return out


def vision_to_hf(state_dict: dict, source: str) -> dict[str, torch.Tensor]:
    """An OpenAI-style ViT (open_clip's `visual.`, Chinese-CLIP's too) in transformers' naming,
    with its projection."""
    s = state_dict
    return {
        "vision_model.embeddings.patch_embedding.weight": s[f"{source}conv1.weight"],
        "vision_model.embeddings.class_embedding": s[f"{source}class_embedding"],
        "vision_model.embeddings.position_embedding.weight": s[f"{source}positional_embedding"],
        "vision_model.pre_layrnorm.weight": s[f"{source}ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": s[f"{source}ln_pre.bias"],
        "vision_model.post_layernorm.weight": s[f"{source}ln_post.weight"],
        "vision_model.post_layernorm.bias": s[f"{source}ln_post.bias"],
        "visual_projection.weight": s[f"{source}proj"].t().contiguous(),
        **_blocks(s, f"{source}transformer.resblocks.", "vision_model.encoder.layers."),
    }


def open_clip_to_clip(state_dict: dict) -> dict[str, torch.Tensor]:
    """open_clip CLIP (or CustomTextCLIP with its own text transformer) -> CLIPModel's names."""
    t = "text." if "text.token_embedding.weight" in state_dict else ""
    s = state_dict
    return {
        **vision_to_hf(s, "visual."),
        "text_model.embeddings.token_embedding.weight": s[f"{t}token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": s[f"{t}positional_embedding"],
        "text_model.final_layer_norm.weight": s[f"{t}ln_final.weight"],
        "text_model.final_layer_norm.bias": s[f"{t}ln_final.bias"],
        "text_projection.weight": s[f"{t}text_projection"].t().contiguous(),
        "logit_scale": s["logit_scale"].reshape(()),
        **_blocks(s, f"{t}transformer.resblocks.", "text_model.encoder.layers."),
    }


def open_clip_to_chinese_clip(state_dict: dict) -> dict[str, torch.Tensor]:
    """open_clip ViT + HF BERT tower (already in transformers' naming) -> ChineseCLIPModel's."""
    tower = "text.transformer."
    return {
        **vision_to_hf(state_dict, "visual."),
        **{
            "text_model." + key[len(tower) :]: value
            for key, value in state_dict.items()
            if key.startswith(tower) and not key[len(tower) :].startswith("pooler.")
        },
        "text_projection.weight": state_dict["text.proj.weight"],
        "logit_scale": state_dict["logit_scale"].reshape(()),
    }


# --- Chinese-CLIP's own checkpoints -----------------------------------------------------------


# What a Chinese-CLIP checkpoint of a ViT model holds (its ResNet-50 model has no class token).
ORIGINAL_KEYS = (
    "visual.conv1.weight",
    "visual.class_embedding",
    "visual.positional_embedding",
    "visual.transformer.resblocks.0.mlp.c_fc.weight",
    "visual.proj",
    "bert.embeddings.word_embeddings.weight",
    "bert.encoder.layer.0.intermediate.dense.weight",
    "text_projection",
    "logit_scale",
)


def chinese_clip_state_dict(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The model's parameters in a Chinese-CLIP training checkpoint ({"state_dict": ...} saved
    from DistributedDataParallel: `module.` prefixes), or a bare state dict."""
    state = checkpoint.get("state_dict", checkpoint)
    return {k.removeprefix("module."): v for k, v in state.items()}


def chinese_clip_from_original(state: dict[str, torch.Tensor]):
    """A ChineseCLIPModel holding a Chinese-CLIP checkpoint's weights. The .pt has no config: the
    sizes are read off the tensors; heads are width // 64 on both towers (the ViT's as
    Chinese-CLIP's model code computes them, BERT's as every one of its text configs has
    them); the ViT uses QuickGELU, as Chinese-CLIP's VisualTransformer does."""
    width = state["visual.conv1.weight"].shape[0]
    patch = state["visual.conv1.weight"].shape[-1]
    positions = state["visual.positional_embedding"].shape[0] - 1
    vision_layers = _count_blocks(state, "visual.transformer.resblocks.")
    vision = {
        "hidden_size": width,
        "intermediate_size": state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        "num_hidden_layers": vision_layers,
        "num_attention_heads": width // 64,
        "image_size": patch * round(positions**0.5),
        "patch_size": patch,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": OPEN_CLIP_LN_EPS,
    }
    words = state["bert.embeddings.word_embeddings.weight"]
    hidden = words.shape[1]
    text = {
        "vocab_size": words.shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": _count_blocks(state, "bert.encoder.layer."),
        "num_attention_heads": hidden // 64,
        "intermediate_size": state["bert.encoder.layer.0.intermediate.dense.weight"].shape[0],
        "max_position_embeddings": state["bert.embeddings.position_embeddings.weight"].shape[0],
        "type_vocab_size": state["bert.embeddings.token_type_embeddings.weight"].shape[0],
    }
    embed_dim = state["text_projection"].shape[1]
    model = _chinese_clip(text, vision, embed_dim)
    weights = {
        **vision_to_hf(state, "visual."),
        **{
            "text_model." + key[len("bert.") :]: value
            for key, value in state.items()
            if key.startswith("bert.") and not key.startswith("bert.pooler.")
        },
        "text_projection.weight": state["text_projection"].t().contiguous(),
        "logit_scale": state["logit_scale"].reshape(()),
    }
    model.load_state_dict(weights, strict=True)
    return model


def _count_blocks(state: dict, prefix: str) -> int:
    indices = {int(k[len(prefix) :].split(".")[0]) for k in state if k.startswith(prefix)}
    return max(indices) + 1
