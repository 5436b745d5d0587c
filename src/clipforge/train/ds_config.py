"""The DeepSpeed config, generated from a handful of params and written out for inspection.

Users never edit a DeepSpeed JSON: every value below follows from TrainConfig, the batch plan
and the device, and the result lands in checkpoints/<run>/deepspeed_config.json.
"""

from __future__ import annotations

from clipforge.errors import StageError
from clipforge.train.config import BatchPlan, TrainConfig

# Never let DeepSpeed print its own per-step lines; clipforge logs progress itself.
_QUIET_STEPS = 10**9


# Why a device cannot train in bf16 (clipforge.train.dist.device_has_bf16 decides).
_NO_BF16 = {
    "cuda": "NVIDIA GPUs compute bf16 from Ampere, compute capability 8.0, on",
    "cpu": "this torch's gloo backend carries no bf16 tensors, as torch 2.1's, the image's",
}


def resolve_precision(requested: str, device: str, bf16_supported: bool) -> str:
    """`auto`: bf16 on GPUs that have it, fp32 on CPUs (the demo's numbers, and fp32 is faster
    there without bf16 matrix instructions); `bf16` is honoured on any device that has it."""
    if requested == "auto":
        return "bf16" if device == "cuda" and bf16_supported else "fp32"
    if requested == "bf16" and not bf16_supported:
        raise StageError(
            f"train.precision: bf16 requested but this {'GPU' if device == 'cuda' else 'CPU'} "
            f"cannot train in bf16 ({_NO_BF16[device]}): set train.precision: fp32, or auto"
        )
    return requested


def use_torch_adam(optimizer: str, device: str) -> bool:
    """DeepSpeed's fused Adam is a CUDA kernel; on CPU its only alternative needs a JIT compile."""
    return optimizer == "torch" or (optimizer == "auto" and device == "cpu")


def fused_torch_adam(optimizer: str, device: str) -> dict:
    """torch's AdamW in one fused kernel (CUDA, and CPU since torch 2.4) where DeepSpeed hands
    the step to torch: DeepSpeed passes unknown optimizer params through to torch.optim.AdamW,
    whose default otherwise is the multi-tensor path, several passes over the fp32 master
    weights and both moments instead of one. torch before 2.4 (the image's 2.1) has no CPU
    kernel and refuses `fused` there: the multi-tensor path then."""
    fused = device == "cuda" or fused_adamw_on_cpu()
    return {"fused": True} if fused and use_torch_adam(optimizer, device) else {}


def fused_adamw_on_cpu() -> bool:
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 4)


def deepspeed_bf16(precision: str, zero_stage: int, locks_a_tower: bool = False) -> bool:
    """bf16 weights in DeepSpeed's own bf16 mode, where it accumulates gradients in fp32.

    With `data_types.grad_accum_dtype: fp32` DeepSpeed (0.14.5 to 0.19 at least) keeps bf16
    weights, accumulates and reduces gradients in fp32 and steps fp32 master weights, but only at
    ZeRO-1 (its BF16_Optimizer): its ZeRO-2 and ZeRO-3 optimizers accumulate in the weights' dtype
    whatever the config says, and without ZeRO it refuses bf16 weights with fp32 accumulation.
    There the weights stay fp32 and the forward runs under bf16 autocast (`uses_autocast`), which
    gives the same fp32 accumulation at every stage.

    Not with a tower locked (train.lock_image, lock_text): the mode keeps fp32 master weights of
    the parameters its optimizer steps only, so a locked tower would be held, and exported, in
    bf16, its start weights rounded for good. fp32 weights under autocast keep them exact."""
    return precision == "bf16" and zero_stage == 1 and not locks_a_tower


def uses_autocast(precision: str, zero_stage: int, locks_a_tower: bool = False) -> bool:
    return precision == "bf16" and not deepspeed_bf16(precision, zero_stage, locks_a_tower)


def deepspeed_config(train: TrainConfig, plan: BatchPlan, device: str, precision: str) -> dict:
    zero: dict = {"stage": train.zero_stage}
    if train.zero_stage == 3:
        # Export reads fp32 weights from the checkpoint (zero_to_fp32), so no 16-bit gather on save.
        zero.update(stage3_gather_16bit_weights_on_model_save=False)
    if device == "cuda":
        zero.update(overlap_comm=True, contiguous_gradients=True)
    return {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": train.grad_clip_norm,
        "bf16": {"enabled": deepspeed_bf16(precision, train.zero_stage, train.locks_a_tower)},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": train.lr,
                "betas": [train.beta1, train.beta2],
                "eps": train.eps,
                "weight_decay": train.weight_decay,
                "torch_adam": use_torch_adam(train.optimizer, device),
                "adam_w_mode": True,
                **fused_torch_adam(train.optimizer, device),
            },
        },
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device before every forward; clipforge
        # measures throughput itself, once per log interval.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }
