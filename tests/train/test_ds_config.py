"""The generated DeepSpeed config: a few params in, every DeepSpeed value derived."""

from __future__ import annotations

import pytest
import torch

from clipforge.errors import StageError
from clipforge.pipeline.params import load_pipeline_params
from clipforge.pipeline.recipe import recipe_params
from clipforge.train.config import batch_plan
from clipforge.train.dist import resolve_device
from clipforge.train.ds_config import (
    deepspeed_bf16,
    deepspeed_config,
    resolve_precision,
    uses_autocast,
)


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


def test_bf16_on_a_gpu_without_it_is_a_one_line_user_error():
    """A GPU before Ampere has no bf16 arithmetic: the stage's one line (StageError, exit 2)
    naming the key and what to set instead."""
    with pytest.raises(StageError) as refused:
        resolve_precision("bf16", "cuda", False)
    message = str(refused.value)
    assert message.startswith("train.precision: bf16 requested but this GPU cannot train in bf16")
    assert "compute capability 8.0" in message
    assert "set train.precision: fp32, or auto" in message and "\n" not in message


def test_bf16_is_a_precision_of_the_cpu_and_auto_stays_fp32_there():
    """Explicit bf16 runs on a CPU that has it (the suite's bf16 runs: BF16_SETS in
    tests/conftest.py); `auto` keeps the demo's fp32 there and takes bf16 on GPUs that have it. A
    CPU stack without it (the image's torch 2.1, whose gloo carries no bf16) is told so in one
    line."""
    assert resolve_precision("bf16", "cpu", True) == "bf16"
    assert resolve_precision("auto", "cpu", True) == "fp32"
    with pytest.raises(StageError, match="this CPU cannot train in bf16 .*gloo.*torch 2.1"):
        resolve_precision("bf16", "cpu", False)
    assert resolve_precision("auto", "cuda", True) == "bf16"
    assert resolve_precision("auto", "cuda", False) == "fp32"


def test_bf16_weights_only_at_zero1_autocast_at_every_other_stage():
    """DeepSpeed's bf16 mode (bf16 weights, fp32 accumulation) exists at ZeRO-1 only; ZeRO-0,
    which DeepSpeed 0.19 refuses in that mode, trains fp32 weights under autocast like ZeRO-2/3."""
    assert [deepspeed_bf16("bf16", stage) for stage in range(4)] == [False, True, False, False]
    assert [uses_autocast("bf16", stage) for stage in range(4)] == [True, False, True, True]
    assert not any(deepspeed_bf16("fp32", s) or uses_autocast("fp32", s) for s in range(4))


def test_a_locked_tower_keeps_fp32_weights_under_autocast_at_zero1_too():
    """The lit-zh recipe, bf16 at ZeRO-1 with its image tower locked: not DeepSpeed's bf16 mode,
    which keeps no fp32 copy of a weight its optimizer does not step (a locked tower would be
    rounded to bf16 for good; tests/export/test_export_and_eval.py reads it back exact)."""
    train = recipe_params("lit-zh").train
    assert train.lock_image and train.zero_stage == 1
    config = deepspeed_config(train, batch_plan(train), "cuda", "bf16")
    assert config["bf16"] == {"enabled": False}
    assert not deepspeed_bf16("bf16", 1, locks_a_tower=True)
    assert uses_autocast("bf16", 1, locks_a_tower=True)


def test_bf16_above_zero1_keeps_fp32_weights_for_autocast():
    """DeepSpeed's ZeRO-2/3 accumulate in the weights' dtype: bf16 there is autocast."""
    train = recipe_params("production-large").train
    config = deepspeed_config(train, batch_plan(train), "cuda", "bf16")
    assert config["zero_optimization"]["stage"] == 3
    assert config["bf16"] == {"enabled": False}
    assert uses_autocast("bf16", 3) and uses_autocast("bf16", 2)
    assert not uses_autocast("bf16", 1) and not uses_autocast("fp32", 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_visible_gpu_is_one_line_and_auto_is_the_cpu():
    """`train.device: auto` takes the CPU where no GPU is visible; `cuda` there is the stage's
    one line naming the settings that train on the CPU."""
    assert resolve_device("auto") == "cpu"
    with pytest.raises(StageError, match="train.device: cuda requested but no GPU is visible"):
        resolve_device("cuda")
