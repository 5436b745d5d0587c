"""`train.micro_batch_size: auto` on GPUs: the largest micro batch that fits, found by trying.

One wrong digit in a hand-set micro batch is an out-of-memory crash hours into a queue; `auto`
tries instead. The candidates are the divisors of the rank's share of the global batch (so the
accumulation is a whole number); a binary search over them runs one real forward + backward of
the model per try and treats out-of-memory as "does not fit". While it tries, memory the
DeepSpeed engine will need later (optimizer states, the fp32 accumulation buffer) and a safety
margin are held by a ballast allocation, so the choice still fits once training runs.

The search is pure (`largest_fitting`, with the fits/doesn't-fit oracle injected); the oracle
(`forward_backward_fits`) works on any device whose allocator raises on exhaustion: CUDA, or a
CPU process under an address-space limit (the tests).
"""

from __future__ import annotations

import copy
import gc
import json
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from clipforge.fields import ConfigError

log = logging.getLogger("clipforge.train")

SAFETY_MARGIN = (
    0.10  # share of the device's memory kept free: fragmentation, NCCL, the feature cache
)
PLAN_FILE = "batch_plan.json"  # in the run directory: the probed micro batch, reused on resume


def candidates(share: int) -> list[int]:
    """Micro batches that divide a rank's share of the global batch, smallest first."""
    return [m for m in range(1, share + 1) if share % m == 0]


def largest_fitting(options: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    """The largest option that fits, by binary search (fitting is monotone: if m fits, every
    smaller option does); None when not even the smallest fits."""
    fitting, failing = -1, len(options)  # indices known to fit / known not to
    while failing - fitting > 1:
        middle = (fitting + failing) // 2
        if fits(options[middle]):
            fitting = middle
        else:
            failing = middle
    return options[fitting] if fitting >= 0 else None


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def forward_backward_fits(
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    image_size: int,
    context_length: int,
    reserve_bytes: int,
    autocast: Callable[[], AbstractContextManager],
    teacher: Callable | None = None,
) -> Callable[[int], bool]:
    """An oracle: does one forward + backward of a micro batch of m pairs fit, while
    `reserve_bytes` are held for what the training engine will allocate later? With a
    distillation `teacher` (its weights already on the device), its forward of the micro batch
    runs first and its features stay alive through the student's, as in a step."""

    def fits(m: int) -> bool:
        held: list[torch.Tensor] = []
        try:
            held.append(torch.empty(reserve_bytes, dtype=torch.uint8, device=device))
            # its own generator: the probe must not move the training's random streams
            generator = torch.Generator(device).manual_seed(0)
            shape = (m, 3, image_size, image_size)
            images = torch.randn(shape, device=device, generator=generator).to(dtype)
            texts = torch.randint(1, 1000, (m, context_length), device=device, generator=generator)
            if teacher is not None:
                held.append(teacher(images, texts))
            with autocast():
                out = model(image=images, text=texts)
            logits = out["image_features"].float() @ out["text_features"].float().T
            logits.logsumexp(dim=1).mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return True
        except Exception as exc:  # noqa: BLE001 - only out-of-memory means "does not fit"
            if not is_out_of_memory(exc):
                raise
            return False
        finally:
            held.clear()
            model.zero_grad(set_to_none=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    return fits


def engine_reserve_bytes(
    num_params: int, world_size: int, deepspeed_bf16: bool, device_bytes: int
) -> int:
    """Memory the engine adds beyond the probe's own weights and gradients: AdamW's fp32 master
    weights and two moments, partitioned over the ranks (ZeRO >= 1); DeepSpeed's bf16 mode's full
    fp32 gradient accumulation buffer; plus SAFETY_MARGIN of the device."""
    optimizer = 12 * num_params // world_size
    accumulation = 4 * num_params if deepspeed_bf16 else 0
    return optimizer + accumulation + int(SAFETY_MARGIN * device_bytes)


def probe_micro_batch(share: int, fits: Callable[[int], bool]) -> int:
    """The largest micro batch of `share` that fits; ConfigError naming the remedies if none."""
    chosen = largest_fitting(candidates(share), fits)
    if chosen is None:
        raise ConfigError(
            "train.micro_batch_size: auto found no micro batch that fits in device memory, not "
            "even 1; set train.grad_checkpointing: true, a higher train.zero_stage, or a "
            "smaller model"
        )
    return chosen


def probe_on_gpu(
    model: torch.nn.Module,
    model_cfg: dict,
    device: torch.device,
    share: int,
    world_size: int,
    deepspeed_bf16: bool,
    autocast: Callable[[], AbstractContextManager],
    teacher: Callable | None = None,
) -> int:
    """The largest micro batch whose forward + backward fits this rank's GPU with the engine's
    later needs held back. Runs on a copy in the training dtype: the weights stay untouched. A
    distillation teacher is measured, not estimated: its weights are on the device already, and
    its forward runs in each try."""
    dtype = torch.bfloat16 if deepspeed_bf16 else torch.float32
    probe = copy.deepcopy(model).to(device, dtype)
    try:
        fits = forward_backward_fits(
            probe,
            device,
            dtype,
            model_cfg["vision_cfg"]["image_size"],
            model_cfg["text_cfg"].get("context_length", 77),
            engine_reserve_bytes(
                # the optimizer's part is of the parameters that train: none of a locked tower's
                sum(p.numel() for p in probe.parameters() if p.requires_grad),
                world_size,
                deepspeed_bf16,
                torch.cuda.get_device_properties(device).total_memory,
            ),
            autocast,
            teacher,
        )
        chosen = probe_micro_batch(share, fits)
    finally:
        del probe
        torch.cuda.empty_cache()
    log.info("micro batch probe on %s: %d of %d pairs fits", device, chosen, share)
    return chosen


def saved_micro_batch(run_dir: Path) -> int | None:
    """The micro batch a run chose when it started (None for a new run)."""
    path = run_dir / PLAN_FILE
    if not path.is_file():
        return None
    return int(json.loads(path.read_text(encoding="utf-8"))["micro_batch_size"])


def plan_record(micro_batch_size: int, grad_accum_steps: int, world_size: int, how: str) -> str:
    return (
        json.dumps(
            {
                "micro_batch_size": micro_batch_size,
                "grad_accum_steps": grad_accum_steps,
                "world_size": world_size,
                "chosen_by": how,
            },
            indent=2,
        )
        + "\n"
    )
