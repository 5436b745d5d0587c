"""The distillation teacher (train.distill_model): a frozen model whose logits the student learns.

Loaded by the one loader of named models (clipforge.export.loading, as eval loads its model and
baseline), frozen and in eval mode on the rank's device, outside DeepSpeed's engine and the
optimizer. Its features are computed once per micro batch without gradients (the step,
clipforge.train.loss, concatenates them like the student's cache), in bf16 where the run is bf16;
a CPU run's default precision is fp32, and so is its teacher's (bf16 matmuls are slow there).

The teacher sees the student's inputs (the same augmented pixels, the same token ids), as
open_clip_train's distillation does; so both must preprocess and tokenise alike. That is checked
on a probe image and probe captions at start-up, not assumed from the names: a Chinese-CLIP
teacher (BERT tokens at 52, a squashed image) is refused for a student with open_clip's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from PIL import Image

from clipforge.export.loading import load_model
from clipforge.fields import ConfigError
from clipforge.model.factory import ClipBundle
from clipforge.train.config import TrainConfig

log = logging.getLogger("clipforge.train")

# Captions the tokenizers are compared on: Chinese, English, and one past any context length.
_PROBE_TEXTS = ("一只猫坐在窗台上", "a dog running on the beach", "长" * 100 + " word" * 100)


def _probe_image() -> Image.Image:
    """A non-square picture with detail everywhere: a resize, a crop or a squash changes it."""
    pixels = torch.arange(96 * 64 * 3, dtype=torch.int64).reshape(64, 96, 3) * 37 % 251
    return Image.fromarray(pixels.to(torch.uint8).numpy(), "RGB")


@dataclass(frozen=True)
class TeacherFeatures:
    """One micro batch seen by the teacher: normalised features, fp32, and its temperature."""

    image: torch.Tensor
    text: torch.Tensor
    logit_scale: torch.Tensor  # 0-dim: exp of the teacher's learned logit_scale


class Teacher:
    """A loaded model (open_clip's, or clipforge.export.loading's ChineseClipEncoder), frozen."""

    def __init__(self, model, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        module = _module(model)
        module.requires_grad_(False)
        module.eval()
        # frozen: its temperature is a constant of the run, read before a cast to bf16 rounds it
        learned: torch.Tensor = getattr(module, "logit_scale")  # noqa: B009 - typed for mypy
        self.logit_scale = learned.detach().float().exp().reshape(())
        module.to(dtype)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, texts: torch.Tensor) -> TeacherFeatures:
        images = images.to(self.dtype)
        return TeacherFeatures(
            self.model.encode_image(images, normalize=True).float(),
            self.model.encode_text(texts, normalize=True).float(),
            self.logit_scale,
        )

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in _module(self.model).parameters())


def _module(model) -> torch.nn.Module:
    """The torch module of a loaded model: open_clip's is one; a ChineseClipEncoder holds one."""
    return model if isinstance(model, torch.nn.Module) else model.model


def teacher_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def load_teacher(
    train: TrainConfig, student: ClipBundle, student_name: str, device: torch.device, precision: str
) -> Teacher | None:
    """train.distill_model on `device`, checked to take the student's inputs; None without one."""
    if train.distill_model is None:
        return None
    model, preprocess, tokenizer = load_model(
        train.distill_model, train.distill_pretrained, str(device), "train.distill_model"
    )
    check_same_inputs(
        (preprocess, tokenizer),
        (student.preprocess_val, student.tokenizer),
        train.distill_model,
        student_name,
    )
    teacher = Teacher(model, teacher_dtype(precision))
    log.info(
        "distilling from %s: %.1f MB of %s weights on %s, loss weight %g",
        train.distill_model,
        teacher.parameter_bytes() / 2**20,
        teacher.dtype,
        device,
        train.distill_weight,
    )
    return teacher


def check_same_inputs(teacher: tuple, student: tuple, teacher_name: str, student_name: str) -> None:
    """ConfigError, in one line naming both models, unless the teacher's (preprocess, tokenizer)
    turn the probe image and captions into exactly the student's tensors."""
    image = _probe_image()
    pixels = [preprocess(image) for preprocess, _ in (teacher, student)]
    tokens = [torch.as_tensor(tokenize(list(_PROBE_TEXTS))) for _, tokenize in (teacher, student)]
    if pixels[0].shape != pixels[1].shape:
        differs = f"its images are {_shape(pixels[0])}, the student's {_shape(pixels[1])}"
    elif not torch.equal(pixels[0], pixels[1]):
        differs = "its image preprocessing (crop or normalisation) differs from the student's"
    elif tokens[0].shape != tokens[1].shape:
        differs = (
            f"its tokenizer's context is {tokens[0].shape[-1]} tokens, the student's "
            f"{tokens[1].shape[-1]}"
        )
    elif not torch.equal(tokens[0], tokens[1]):
        differs = "its tokenizer gives other token ids than the student's"
    else:
        return
    raise ConfigError(
        f"train.distill_model: the teacher {teacher_name} cannot take the inputs of the student "
        f"{student_name}: {differs}; choose a teacher and a student (model.name, "
        f"model.image_size, model.text_tower) that preprocess and tokenise alike"
    )


def _shape(pixels: torch.Tensor) -> str:
    return "x".join(str(n) for n in pixels.shape[-2:]) + " px"
