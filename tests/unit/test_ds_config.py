"""The generated DeepSpeed config: a few params in, every DeepSpeed value derived."""

from __future__ import annotations

import pytest

from clipforge.pipeline.params import load_pipeline_params
from clipforge.pipeline.recipe import recipe_params
from clipforge.train.config import batch_plan
from clipforge.train.ds_config import deepspeed_config, resolve_precision, uses_autocast


def test_production_recipe_gives_zero1_bf16_fp32_accumulation_fused_adam_on_gpus():
    train = recipe_params("production").train
    config = deepspeed_config(
        train, batch_plan(train), "cuda", resolve_precision("auto", "cuda", True)
    )
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (4096, 1024, 1)
    assert config["zero_optimization"]["stage"] == 1
    assert config["bf16"] == {"enabled": True}
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    # DeepSpeed's throughput timer would synchronise the device before every forward
    assert config["timers"]["throughput"] == {"enabled": False, "synchronized": False}
    params = config["optimizer"]["params"]
    assert (params["lr"], params["betas"], params["eps"], params["weight_decay"]) == (
        5e-4,
        [0.9, 0.98],
        1e-6,
        0.2,
    )
    assert params["torch_adam"] is False  # DeepSpeed's fused CUDA kernel
    assert "fused" not in params  # a torch AdamW argument, for torch's AdamW only


def test_cpu_default_is_fp32_with_torch_adam():
    """On CPU: no bf16, and torch's AdamW (DeepSpeed's CPU Adam would JIT-compile first)."""
    train = load_pipeline_params(None).train
    config = deepspeed_config(
        train, batch_plan(train), "cpu", resolve_precision("auto", "cpu", False)
    )
    assert config["bf16"] == {"enabled": False}
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert config["optimizer"]["params"]["fused"] is True  # torch's fused AdamW, on CPU too
    assert config["gradient_clipping"] == train.grad_clip_norm


def test_bf16_on_a_device_without_it_is_refused():
    with pytest.raises(ValueError, match="train.precision: bf16 requested"):
        resolve_precision("bf16", "cpu", False)


def test_bf16_above_zero1_keeps_fp32_weights_for_autocast():
    """DeepSpeed's ZeRO-2/3 accumulate in the weights' dtype: bf16 there is autocast."""
    train = recipe_params("production-large").train
    config = deepspeed_config(train, batch_plan(train), "cuda", "bf16")
    assert config["zero_optimization"]["stage"] == 3
    assert config["bf16"] == {"enabled": False}
    assert uses_autocast("bf16", 3) and uses_autocast("bf16", 2)
    assert not uses_autocast("bf16", 1) and not uses_autocast("fp32", 3)
