"""MFU's two halves: model FLOPs per training sample from the config, and the device peak."""

from __future__ import annotations

import open_clip
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from clipforge.model.names import register_bundled_configs
from clipforge.train.flops import datasheet_peak, flops_per_sample, mfu, peak_flops


def _attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _counted_training_flops(name: str, image_size: int, lock_image: bool = False) -> float:
    """forward + backward of one pair, counted by torch's own FLOP counter."""
    torch.manual_seed(0)
    model = open_clip.create_model(name, force_image_size=image_size, output_dict=True)
    if lock_image:
        model.lock_image_tower()
    images = torch.randn(2, 3, image_size, image_size)
    texts = torch.randint(1, 49000, (2, model.context_length))
    # torch's counter knows the GPU attention kernels; the CPU one computes the same products
    cpu_attention = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward,
    }
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
        out = model(image=images, text=texts)
        (out["image_features"].sum() + out["text_features"].sum()).backward()
    return counter.get_total_flops() / 2


@pytest.mark.parametrize(("name", "image_size"), [("clipforge-tiny", 64), ("ViT-B-32", 224)])
def test_formula_matches_torch_flop_counter(name, image_size):
    register_bundled_configs()
    config = open_clip.get_model_config(name)
    config["vision_cfg"]["image_size"] = image_size
    # within 2%: the counter skips the patch embedding's input gradient (images need none)
    assert flops_per_sample(config) == pytest.approx(
        _counted_training_flops(name, image_size), rel=0.02
    )


def test_a_locked_image_tower_costs_its_forward_only():
    """open_clip's lock_image_tower, as train.lock_image applies it: torch's counter sees no
    backward through the image tower, and the formula counts it so."""
    register_bundled_configs()
    config = open_clip.get_model_config("clipforge-tiny")
    config["vision_cfg"]["image_size"] = 64
    counted = _counted_training_flops("clipforge-tiny", 64, lock_image=True)
    assert flops_per_sample(config, image_trains=False) == pytest.approx(counted, rel=0.02)
    assert flops_per_sample(config, image_trains=False) < 0.8 * flops_per_sample(config)


def test_vit_b32_costs_about_44_gflop_per_training_sample():
    assert flops_per_sample(open_clip.get_model_config("ViT-B-32")) == pytest.approx(
        44.4e9, rel=0.01
    )


def test_towers_the_formula_does_not_describe_give_no_flops():
    assert flops_per_sample(open_clip.get_model_config("xlm-roberta-base-ViT-B-32")) is None
    assert flops_per_sample(open_clip.get_model_config("RN50")) is None


def test_mfu_is_model_flops_over_the_peak_of_all_ranks():
    # the target: 7,000 samples/s of ViT-B/32 on one 790 TFLOP/s H200 is ~39% MFU
    assert mfu(7000, 44.4e9, 790e12, 1) == pytest.approx(0.393, abs=0.001)
    assert mfu(14000, 44.4e9, 790e12, 2) == pytest.approx(0.393, abs=0.001)
    assert mfu(7000, None, 790e12, 1) is None


def test_cpu_and_fp32_have_no_peak_so_no_mfu():
    """A ratio to a peak nobody published is noise: MFU is reported only against a datasheet."""
    assert peak_flops("cpu", "fp32") is None
    assert peak_flops("cuda", "fp32") is None


@pytest.mark.parametrize(
    ("name", "part", "tflops"),
    [
        ("NVIDIA H200", "H200 SXM", 989),
        ("NVIDIA H200 NVL", "H200 NVL", 835),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756),
        ("NVIDIA H100 NVL", "H100 NVL", 835),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM", 312),
        ("NVIDIA A100-SXM4-40GB", "A100 SXM", 312),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe", 312),
        ("NVIDIA A800-SXM4-80GB", "A800 SXM", 312),
    ],
)
def test_the_datasheet_peak_is_the_exact_parts(name, part, tflops):
    """PCIe and NVL parts never match the SXM entry of their family."""
    assert datasheet_peak(name) == (part, tflops * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA GH200 480GB", "NVIDIA L40S", "Tesla V100-SXM2-32GB"])
def test_an_unknown_part_has_no_peak(name):
    assert datasheet_peak(name) is None


def test_vit_b32_training_flops_per_sample():
    """The number the field quotes for ViT-B/32 at 224 px: 44.33 GFLOP per sample."""
    cfg = open_clip.get_model_config("ViT-B-32")
    assert flops_per_sample(cfg) / 1e9 == pytest.approx(44.33, abs=0.01)
