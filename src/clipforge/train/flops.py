"""Model FLOPs per training sample and the device's peak rate: the two halves of MFU.

MFU (model FLOPs utilisation) = samples/s x FLOPs per training sample / (peak FLOP/s x ranks),
the peak being the datasheet's dense bf16 rate of the exact GPU part (PaLM's definition).
It counts the model's useful work only: forward plus backward of one sample. The extra no-grad
forward of cached accumulation is overhead and is not counted, nor are norms, activations,
softmax or the optimizer, as is usual (PaLM's definition).

FLOPs of an open_clip ViT + text transformer, from its config (one multiply-add = 2 FLOPs):
  a transformer layer over n tokens of width d, MLP ratio r:
      (4 + 2r) n d^2 multiply-adds in its linear layers, 2 n^2 d in attention (scores, values)
  image tower: n = (image/patch)^2 + 1 (class token); + the patch embedding (image/patch)^2 x
      3 patch^2 d; + the projection d x embed_dim
  text tower: n = context length; + the projection width x embed_dim
  training = 3 x forward (the backward pass costs twice the forward); a tower locked whole:
      1 x its forward.
ViT-B/32 at 224 px: 4.41 G multiply-adds (image) + 2.98 G (text) -> 44.4 GFLOP per sample.
tests/train/test_flops.py checks the formula against torch.utils.flop_counter.
"""

from __future__ import annotations

import re

# Datasheet dense (no sparsity) bf16 tensor-core peak, FLOP/s, of the exact part, matched on
# torch.cuda.get_device_name() in this order: the PCIe and NVL parts share a family name with the
# SXM part and reach less (lower clocks and power), so they are matched first and never fall
# through to the SXM entry. A name no pattern matches has no peak, and so no MFU.
# Names as the driver reports them: "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
# "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB",
# "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA A800-SXM4-80GB".
DATASHEET_BF16_FLOPS = (
    ("H200 NVL", r"\bH200 NVL\b", 835e12),
    ("H200 SXM", r"\bH200\b", 989e12),
    ("H100 NVL", r"\bH100 NVL\b", 835e12),
    ("H100 PCIe", r"\bH100\b.*\bPCIe\b", 756e12),
    ("H100 SXM", r"\bH100\b", 989e12),
    ("H800 PCIe", r"\bH800\b.*\bPCIe\b", 756e12),
    ("H800 SXM", r"\bH800\b", 989e12),
    ("A100 PCIe", r"\bA100\b.*\bPCIe\b", 312e12),  # the same dense peak as the SXM part
    ("A100 SXM", r"\bA100\b", 312e12),
    ("A800 PCIe", r"\bA800\b.*\bPCIe\b", 312e12),
    ("A800 SXM", r"\bA800\b", 312e12),
)


def datasheet_peak(device_name: str) -> tuple[str, float] | None:
    """(the part matched, its dense bf16 peak) for a CUDA device name; None when unknown."""
    for part, pattern, rate in DATASHEET_BF16_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return part, rate
    return None


def _layer_macs(tokens: int, width: int, mlp_ratio: float) -> float:
    return (4 + 2 * mlp_ratio) * tokens * width**2 + 2 * tokens**2 * width


def _side(size) -> int:
    return size if isinstance(size, int) else size[0]


def flops_per_sample(
    model_cfg: dict, image_trains: bool = True, text_trains: bool = True
) -> float | None:
    """Training FLOPs (forward + backward) of one image-caption pair; None for towers the
    formula does not describe (Hugging Face text towers, timm or ResNet image towers). A tower
    that does not train (locked whole: train.lock_image, lock_text) costs its forward only: no
    backward runs through it."""
    vision, text = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    if "layers" not in vision or isinstance(vision["layers"], (list, tuple)):
        return None
    if "timm_model_name" in vision and vision["timm_model_name"]:
        return None
    if text.get("hf_model_name") or "layers" not in text:
        return None
    embed = model_cfg["embed_dim"]
    side = _side(vision.get("image_size", 224)) // vision["patch_size"]
    patches, width = side * side, vision["width"]
    image = (
        patches * 3 * vision["patch_size"] ** 2 * width
        + vision["layers"] * _layer_macs(patches + 1, width, vision.get("mlp_ratio", 4.0))
        + width * embed
    )
    text_width = text.get("width", 512)
    words = (
        text.get("layers", 12)
        * _layer_macs(text.get("context_length", 77), text_width, text.get("mlp_ratio", 4.0))
        + text_width * embed
    )
    return 2 * ((3 if image_trains else 1) * image + (3 if text_trains else 1) * words)


def peak_flops(device: str, precision: str) -> float | None:
    """Peak FLOP/s of one rank's device for MFU: the datasheet's dense bf16 rate of a known GPU
    part; None for anything else (fp32, CPUs, unknown parts), and MFU is then not reported: a
    ratio to a peak nobody published is noise."""
    import torch

    if device != "cuda" or precision != "bf16":
        return None
    part = datasheet_peak(torch.cuda.get_device_name())
    return part[1] if part else None


def mfu(
    samples_per_s: float,
    flops_per_sample: float | None,
    peak_per_rank: float | None,
    world_size: int,
) -> float | None:
    if not flops_per_sample or not peak_per_rank:
        return None
    return samples_per_s * flops_per_sample / (peak_per_rank * world_size)
