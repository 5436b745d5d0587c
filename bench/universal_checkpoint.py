"""What loading a checkpoint at another data-parallel size costs: DeepSpeed's universal checkpoint
(what clipforge.checkpoints.checkpointer does) against the alternative, a consolidated optimizer
state written with every save.

    .venv/bin/python bench/universal_checkpoint.py [--model ViT-B-32] [--out /tmp/ucp-bench]

Two CPU ranks (gloo) train one step of the open_clip model under ZeRO-1 (fp32, torch AdamW, as
on CPU) and save a checkpoint; then:
  - universal: `ds_to_universal` as the checkpointer runs it (one process each), timed, and the
    load of its output into a one-rank engine, timed;
  - consolidated: at the save, every rank gathering each parameter's full fp32 value and Adam
    moments (deepspeed.utils.safe_get_full_*) and rank 0 writing them, timed: what every save
    would pay for a checkpoint that loads at any size.
Results (docs/faults.md, "Fewer GPUs, same run") are printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

TAG = "step-00000001"


def _engine(model_name: str, world: int):
    import deepspeed
    import open_clip
    import torch

    from clipforge.train.engine import make_learned_scalars_1d

    model = open_clip.create_model(model_name, pretrained=None)
    make_learned_scalars_1d(model)  # as the train stage does: DeepSpeed cannot broadcast a 0-d one
    config = {
        "train_batch_size": world,
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _step(engine) -> None:
    import torch

    images = torch.randn(1, 3, 224, 224)
    texts = torch.randint(0, 49408, (1, 77))
    out = engine(images, texts)
    loss = out[0].float().pow(2).mean() + out[1].float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _rank(rank: int, world: int, port: int, model_name: str, out: str, result: dict) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    deepspeed.init_distributed(dist_backend="gloo")
    engine = _engine(model_name, world)
    _step(engine)
    began = time.monotonic()
    engine.save_checkpoint(out, tag=TAG, save_latest=False)
    dist.barrier()
    saved = time.monotonic() - began
    began = time.monotonic()
    full = {}
    for name, param in engine.module.named_parameters():
        full[name] = {
            "fp32": safe_get_full_fp32_param(param),
            "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq"),
        }
    if rank == 0:
        torch.save(full, os.path.join(out, "consolidated.pt"))
    dist.barrier()
    if rank == 0:
        result.update(
            save_seconds=round(saved, 2),
            consolidate_seconds=round(time.monotonic() - began, 2),
            consolidated_mb=round(os.path.getsize(os.path.join(out, "consolidated.pt")) / 1e6),
        )
    dist.destroy_process_group()


def _load_universal(_index: int, port: int, model_name: str, universal: str, result: dict) -> None:
    import deepspeed
    import torch.distributed as dist

    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    deepspeed.init_distributed(dist_backend="gloo")
    engine = _engine(model_name, 1)
    engine._config.load_universal_checkpoint = True
    began = time.monotonic()
    path, _ = engine.load_checkpoint(universal, tag="universal")
    assert path is not None
    result["universal_load_seconds"] = round(time.monotonic() - began, 2)
    dist.destroy_process_group()


def _tree_mb(path: Path) -> int:
    return round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6)


def main() -> None:
    import torch.multiprocessing as mp

    from clipforge.train.dist import free_port

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--out", default="/tmp/ucp-bench")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    manager = mp.Manager()
    result = manager.dict()
    mp.spawn(_rank, args=(2, free_port(), args.model, str(out), result), nprocs=2)
    checkpoint = out / TAG
    consolidated = out / "consolidated.pt"
    consolidated.unlink()  # not part of the checkpoint the tool converts
    began = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            *("--input_folder", str(checkpoint), "--output_folder", str(checkpoint / "universal")),
            "--inject_missing_state",
            *("--num_extract_workers", "1", "--num_merge_workers", "1"),
        ],
        check=True,
        capture_output=True,
    )
    convert = time.monotonic() - began
    mp.spawn(_load_universal, args=(free_port(), args.model, str(checkpoint), result), nprocs=1)
    import deepspeed
    import torch

    print(
        json.dumps(
            {
                "model": args.model,
                "deepspeed": deepspeed.__version__,
                "torch": torch.__version__,
                "checkpoint_mb": _tree_mb(checkpoint) - _tree_mb(checkpoint / "universal"),
                "universal_mb": _tree_mb(checkpoint / "universal"),
                "convert_seconds": round(convert, 2),
                **dict(result),
            }
        )
    )


if __name__ == "__main__":
    main()
