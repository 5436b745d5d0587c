#!/usr/bin/env python3
"""What FLIP-style patch dropout (`model.patch_dropout`) does to the demo: speed and recall.

Builds the demo's data once (the data stage of the embedded default, params.yaml as committed),
then trains and evaluates it once per value of `model.patch_dropout` (default 0 and 0.5), each
train and eval stage in a process of its own, back to back, and prints one table row per value:
the train stage's steps/s and samples/s (its own perf meter, metrics/train.info.json), its wall
time, and the eval stage's recall on the demo's test set. Patch dropout acts in training only:
eval sees every patch.

Two stage runs back to back on a shared machine compare its load as much as the knob, so the
step is also timed in one process, alternating the values (`--step-rounds`, default 6 rounds of
3 steps each): the demo's model and batch, forward + backward + AdamW, plain PyTorch.

    .venv/bin/python bench/patch_dropout.py [--values 0 0.5] [--keep DIR] [--step-only]

Record the table in BENCHMARKS.md with the machine's load (`uptime`) before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def stage(module: str, args: list[str], cwd: Path, env: dict) -> float:
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, check=True, stdout=subprocess.PIPE
    )
    return time.perf_counter() - began


def step_seconds(values: list[float], rounds: int, steps: int) -> dict[float, list[float]]:
    """Seconds per train step of the demo's model at each patch dropout, alternating."""
    sys.path.insert(0, str(REPO / "src"))
    import torch
    from open_clip import ClipLoss

    from clipforge.model.factory import build_model
    from clipforge.pipeline.params import load_pipeline_params

    config = load_pipeline_params(REPO / "params.yaml", [])
    models = {}
    for value in values:
        torch.manual_seed(0)
        cfg = dataclasses.replace(config.model, patch_dropout=value)
        models[value] = build_model(cfg).model.train()
    batch, size = config.train.global_batch_size, config.model.image_size or 64
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size, size, generator=generator)
    texts = torch.randint(1, 49000, (batch, 72), generator=generator)
    loss_fn = ClipLoss()
    optimizers = {v: torch.optim.AdamW(m.parameters(), lr=1e-4) for v, m in models.items()}
    times: dict[float, list[float]] = {value: [] for value in values}
    for round_ in range(rounds):
        for value in values[:: 1 if round_ % 2 == 0 else -1]:
            model, optimizer = models[value], optimizers[value]
            began = time.perf_counter()
            for _ in range(steps):
                out = model(image=images, text=texts)
                loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            times[value].append((time.perf_counter() - began) / steps)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=float, nargs="+", default=[0.0, 0.5])
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temp dir)")
    parser.add_argument("--step-rounds", type=int, default=6)
    parser.add_argument("--step-only", action="store_true", help="only the in-process step timing")
    args = parser.parse_args(argv)
    times = step_seconds(args.values, args.step_rounds, 3)
    # each round runs the values back to back: their ratio holds up when the load drifts
    print("| model.patch_dropout | step s (median) | rounds, s | speed-up, median of rounds |")
    print("|---:|---:|---|---:|")
    base = times[args.values[0]]
    for value, seconds in times.items():
        rounds = ", ".join(f"{t:.2f}" for t in seconds)
        speedup = statistics.median(b / t for b, t in zip(base, seconds))
        print(f"| {value:g} | {statistics.median(seconds):.3f} | {rounds} | {speedup:.2f}x |")
    if args.step_only:
        return 0
    work = args.keep or Path(tempfile.mkdtemp(prefix="clipforge-patch-dropout-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO / "src")
    env.setdefault("DS_ACCELERATOR", "cpu")
    params = ["--params", str(REPO / "params.yaml")]
    if not (work / "data" / "manifest.json").is_file():
        stage("clipforge.data", [*params, "--out", str(work / "data")], work, env)
    rows = []
    for value in args.values:
        run = work / f"patch_dropout_{value:g}"
        shutil.rmtree(run, ignore_errors=True)
        sets = ["--set", f"model.patch_dropout={value}"]
        outputs = ["--checkpoints", str(run / "checkpoints"), "--logs", str(run / "logs")]
        outputs += ["--model-out", str(run / "models" / "clip"), "--metrics", str(run / "metrics")]
        train_seconds = stage(
            "clipforge.train", [*params, *sets, "--data", str(work / "data"), *outputs], work, env
        )
        eval_args = ["--model", f"local-dir:{run / 'models' / 'clip'}"]
        eval_args += ["--data", str(work / "data" / "test"), "--out", str(run / "eval.json")]
        stage("clipforge.eval", [*params, *eval_args], work, env)
        info = json.loads((run / "metrics" / "train.info.json").read_text())
        recall = json.loads((run / "eval.json").read_text())
        rows.append((value, info, train_seconds, recall))
    print(
        "| model.patch_dropout | train steps/s | samples/s | train stage wall s (steps) "
        "| t2i R@1 / R@5 / R@10 | i2t R@1 / R@5 / R@10 | mean recall |"
    )
    print("|---:|---:|---:|---:|---|---|---:|")
    for value, info, seconds, r in rows:
        steps_per_s = info["samples_per_s"] / (info["samples_seen"] / info["steps"])
        print(
            f"| {value:g} | {steps_per_s:.2f} | {info['samples_per_s']:.1f} "
            f"| {seconds:.0f} ({info['steps']}) "
            f"| {r['t2i_r01']:.2f} / {r['t2i_r05']:.2f} / {r['t2i_r10']:.2f} "
            f"| {r['i2t_r01']:.2f} / {r['i2t_r05']:.2f} / {r['i2t_r10']:.2f} "
            f"| {r['mean_recall']:.2f} |"
        )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
