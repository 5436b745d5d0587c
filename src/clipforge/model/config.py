"""The `model:` section of params.yaml: which open_clip model, weights and text tower.

Which open_clip model is trained, from which weights, with
which text tower. The train stage reads it; the data stage builds a tokenizer spec of it for
data.pretokenize_model.
"""

from __future__ import annotations

from dataclasses import dataclass

from clipforge.fields import Section, knob
from clipforge.model.names import check_model_name


@dataclass(kw_only=True)
class ModelConfig(Section):
    SECTION = "model"

    name: str = knob(
        "clipforge-tiny",
        "open_clip model name (`ViT-B-32`, any open_clip config, or a "
        "bundled clipforge config such as `clipforge-tiny`).",
        nonempty=True,
        check=check_model_name,
    )
    pretrained: str | None = knob(
        None,
        "Initial weights: an open_clip checkpoint file "
        "(.safetensors, or a .pt/.bin loaded with weights_only) or "
        "`local-dir:PATH` of an exported model.",
        path=True,
    )
    text_tower: str | None = knob(
        None,
        "Replace the text tower with a Hugging Face model (hub id or "
        "local folder), e.g. `hfl/chinese-roberta-wwm-ext`; its tokenizer "
        "is used too.",
        path=True,
    )
    image_size: int | None = knob(
        None, "Override the model's input image size (null: the model's own).", ge=16, le=1024
    )
    patch_dropout: float = knob(
        0.0,
        "FLIP-style patch dropout: the share of image patches dropped in training (0: none; "
        "0.5 about halves the image tower's cost per sample, at some recall per step). Training "
        "only: evaluation and the export see every patch.",
        ge=0.0,
        lt=1.0,
    )
