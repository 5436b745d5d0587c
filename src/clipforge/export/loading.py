"""A model as its users load it: plain open_clip, or a Chinese-CLIP model as Chinese-CLIP loads it.

Through plain open_clip as a user would load it, or a Chinese-CLIP model
(its original checkpoint or its transformers form) as Chinese-CLIP evaluates it. The one loader
of every model given by name: eval's model and baseline, and train's distillation teacher
(train.distill_model); here, below both stages, so that neither imports the other."""

from __future__ import annotations

import logging
from pathlib import Path

from clipforge.errors import StageError
from clipforge.model.files import (
    CHINESE_CLIP,
    CHINESE_CLIP_VOCAB,
    LOCAL_DIR,
    ModelFilesError,
    chinese_clip_files,
    local_dir_weights,
    looks_like_a_file,
)
from clipforge.util import first_line


def load_open_clip(spec: str, pretrained: str | None, device: str, what: str | None = None):
    """(model, preprocess, tokenizer) through plain open_clip, as a user would, except that the
    weights must fill the whole model (clipforge.model.load_weights): open_clip alone would
    evaluate a randomly initialised model when a folder has no weights file. Weights that cannot
    be had (no network and not cached, an unknown tag) are a StageError in one line."""
    import open_clip

    from clipforge.model.factory import load_weights
    from clipforge.model.names import register_bundled_configs

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


def load_model(spec: str, pretrained: str | None, device: str, what: str | None = None):
    """(model, preprocess, tokenizer) of an eval model: a Chinese-CLIP one (`chinese-clip:PATH`),
    or any open_clip loads. The model has open_clip's encode_image / encode_text."""
    if spec.startswith(CHINESE_CLIP):
        return load_chinese_clip(Path(spec[len(CHINESE_CLIP) :]), device, what or spec)
    return load_open_clip(spec, pretrained, device, what)


def load_chinese_clip(path: Path, device: str, what: str):
    """A Chinese-CLIP model as Chinese-CLIP evaluates it: its BERT wordpiece tokenizer at context
    length 52, and its preprocessing. The original .pt (a training checkpoint, `module.` names)
    is converted to a transformers ChineseCLIPModel in memory (clipforge.export.hf) and
    preprocessed as Chinese-CLIP's own `image_transform` does; a transformers folder brings its
    own image processor."""
    import torch
    from transformers import AutoTokenizer, BertTokenizer, ChineseCLIPModel

    from clipforge.export import hf

    chinese_clip_files(path, what)
    if path.is_file():
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # zip, unpickling: all a bad file here
            raise ModelFilesError(f"{what}: {path} cannot be loaded: {first_line(exc)}") from None
        state = hf.chinese_clip_state_dict(checkpoint if isinstance(checkpoint, dict) else {})
        missing = [key for key in hf.ORIGINAL_KEYS if key not in state]
        if missing:
            raise ModelFilesError(
                f"{what}: {path} is not a Chinese-CLIP ViT checkpoint (no {missing[0]}; "
                f"{len(missing)} of its parameters missing)"
            )
        model = hf.chinese_clip_from_original(state)
        tokenizer = BertTokenizer(str(path.parent / CHINESE_CLIP_VOCAB))
        preprocess = _chinese_clip_transform(model.config.vision_config.image_size)
    else:
        model = ChineseCLIPModel.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        preprocess = _image_processor(path)
    encoder = ChineseClipEncoder(model.to(device), tokenizer.pad_token_id)
    return encoder, preprocess, TextTokens(tokenizer, hf.CHINESE_CLIP_CONTEXT)


def _chinese_clip_transform(side: int):
    """Chinese-CLIP's eval preprocessing (cn_clip/clip/utils.py image_transform): a bicubic squash
    to the square, no crop; OpenAI's mean and std."""
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
    from torchvision import transforms

    return transforms.Compose(
        [
            transforms.Resize((side, side), interpolation=transforms.InterpolationMode.BICUBIC),
            lambda image: image.convert("RGB"),
            transforms.ToTensor(),
            transforms.Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD),
        ]
    )


def _image_processor(path: Path):
    from transformers import ChineseCLIPImageProcessor

    processor = ChineseCLIPImageProcessor.from_pretrained(path)
    return lambda image: processor(images=image, return_tensors="pt")["pixel_values"][0]


class TextTokens:
    """A transformers tokenizer called as open_clip's: texts in, a [N, context] id tensor out,
    padded with the pad id (which the encoder masks)."""

    def __init__(self, tokenizer, context_length: int):
        self.tokenizer, self.context_length = tokenizer, context_length

    def __call__(self, texts):
        return self.tokenizer(
            list(texts),
            padding="max_length",
            truncation=True,
            max_length=self.context_length,
            return_tensors="pt",
        )["input_ids"]


class ChineseClipEncoder:
    """open_clip's encode_image / encode_text over a transformers ChineseCLIPModel (in eval mode,
    on its device)."""

    def __init__(self, model, pad_token_id: int):
        self.model, self.pad_token_id = model.eval(), pad_token_id

    def encode_image(self, pixels, normalize: bool = False):
        features = self.model.get_image_features(pixel_values=pixels)
        return _normalized(features) if normalize else features

    def encode_text(self, input_ids, normalize: bool = False):
        import torch

        # The [CLS] state through the projection, as Chinese-CLIP and ChineseCLIPModel.forward
        # take it; get_text_features reads a pooler output this model does not compute
        # (transformers 4.57: a TypeError).
        hidden = self.model.text_model(
            input_ids=input_ids,
            attention_mask=(input_ids != self.pad_token_id).long(),
            token_type_ids=torch.zeros_like(input_ids),
        ).last_hidden_state[:, 0]
        features = self.model.text_projection(hidden)
        return _normalized(features) if normalize else features


def _normalized(features):
    return features / features.norm(dim=-1, keepdim=True)
