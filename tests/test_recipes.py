"""The ZeRO stage of each production recipe, checked with DeepSpeed's own memory estimator."""

from __future__ import annotations

import open_clip
import torch

from clipforge.pipeline.recipe import recipe_params

GB = 2**30
GPU_MEMORY = 80 * GB  # A800 / A100 80 GB, the recipes' GPUs


def _model_states_per_gpu(name: str, ranks: int) -> dict[int, float]:
    """ZeRO stage -> bytes of weights, gradients and AdamW states on each GPU."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    # Shapes only. open_clip's device="meta" alone still initialises every weight on the CPU
    # first (20 s for ViT-bigG-14); under torch's meta device nothing is allocated (0.4 s).
    with torch.device("meta"):
        model = open_clip.create_model(name, device="meta")
    params = sum(p.numel() for p in model.parameters())
    largest_layer = max(
        sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
    )
    return {
        # DeepSpeed's bf16 mode at ZeRO-1 (the estimator has no ZeRO-1 entry): bf16 weights and
        # gradients, the fp32 accumulation buffer, fp32 master weights + 2 moments partitioned
        1: (2 + 2 + 4) * params + 12 * params / ranks,
        2: estimate_zero2_model_states_mem_needs(params, ranks, 1, False)[1],
        3: estimate_zero3_model_states_mem_needs(params, largest_layer, ranks, 1, False, False)[1],
    }


def test_production_large_uses_zero3_where_zero1_model_states_take_a_quarter_of_the_gpu():
    config = recipe_params("production-large")
    train = config.train
    assert (config.model.name, train.zero_stage, train.grad_checkpointing) == (
        "ViT-bigG-14",
        3,
        True,
    )
    states = _model_states_per_gpu(config.model.name, train.ranks_per_node * train.num_nodes)
    assert states[3] < states[2] < states[1]  # each stage frees memory for activations
    assert states[1] > GPU_MEMORY / 4  # ZeRO-1 would spend over a quarter of each GPU on them
    assert states[3] < GPU_MEMORY / 6


def test_production_vit_b32_fits_zero1_with_room_to_spare():
    """ViT-B/32 under ZeRO-1 uses a few percent of a GPU: no reason to pay for ZeRO-2/3."""
    config = recipe_params("production")
    assert config.train.zero_stage == 1
    states = _model_states_per_gpu(config.model.name, config.train.ranks_per_node)
    assert states[1] < 0.05 * GPU_MEMORY


def test_distill_b32_from_b16s_teacher_takes_its_students_inputs_and_is_its_baseline():
    """The recipe's ViT-B/16 teacher preprocesses and tokenises as its ViT-B/32 student does
    (the train stage's start-up check, on the two architectures' own transforms and tokenizers),
    and eval scores it beside the student."""
    from clipforge.train.teacher import check_same_inputs

    config = recipe_params("distill-b32-from-b16")
    train = config.train
    assert (config.model.name, train.distill_model) == ("ViT-B-32", "ViT-B-16")
    assert (config.eval.baseline_model, config.eval.baseline_pretrained) == (
        train.distill_model,
        train.distill_pretrained,
    )
    inputs = []
    for name in (train.distill_model, config.model.name):
        with torch.device("meta"):  # transforms and tokenizer only: no weights allocated
            _, _, preprocess = open_clip.create_model_and_transforms(name, device="meta")
        inputs.append((preprocess, open_clip.get_tokenizer(name)))
    check_same_inputs(*inputs, train.distill_model, config.model.name)
