#!/usr/bin/env python3
"""Time the demo pipeline from a warm environment, and check what it learns.

Clones the committed repository into a temporary directory (as a user would), then measures
  1. `dvc repro` of the embedded default (params -> data -> train -> eval) end to end: the work
     `make demo` does (there as a DVC experiment in a temporary copy);
  2. a second, no-op `dvc repro`;
and reports text->image R@1 against chance (100 / number of test images).

    .venv/bin/python bench/demo_pipeline.py [--keep DIR]

Targets (issue: core pipeline): end to end <= 5 min on 2 CPU cores, R@1 >= 10x chance; no-op
repro <= 5 s. Record the printed table in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(command: list[str], cwd: Path, env: dict) -> float:
    began = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="clone here and keep it (default: a temp dir)")
    args = parser.parse_args()
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="clipforge-demo-"))
    if workdir.exists() and any(workdir.iterdir()):
        sys.exit(f"{workdir} is not empty")
    subprocess.run(["git", "clone", "-q", str(REPO), str(workdir)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    env["PYTHONPATH"] = str(workdir / "src")
    full = timed(["dvc", "repro"], workdir, env)
    noop = timed(["dvc", "repro"], workdir, env)
    everything = json.loads((workdir / "metrics" / "eval.json").read_text())
    metrics = everything["test"]  # the test split's suite (eval.suites)
    test_set = json.loads((workdir / "metrics" / "eval.info.json").read_text())["suites"]["test"]
    train = json.loads((workdir / "metrics" / "train.info.json").read_text())
    chance = 100.0 / test_set["num_images"]
    rows = [
        ("machine", f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}"),
        ("dvc repro, end to end", f"{full:.0f} s (target <= 300 s)"),
        ("train stage wall time", f"{train['wall_seconds']:.0f} s for {train['steps']} steps"),
        ("no-op dvc repro", f"{noop:.1f} s (target <= 5 s)"),
        (
            "t2i R@1",
            f"{metrics['t2i_r01']:.2f} % = {metrics['t2i_r01'] / chance:.1f}x chance "
            f"({chance:.2f} %, {test_set['num_images']} images; target >= 10x)",
        ),
        ("t2i R@5 / R@10", f"{metrics['t2i_r05']:.2f} / {metrics['t2i_r10']:.2f} %"),
        (
            "i2t R@1 / R@5 / R@10",
            f"{metrics['i2t_r01']:.2f} / {metrics['i2t_r05']:.2f} / {metrics['i2t_r10']:.2f} %",
        ),
        ("mean recall", f"{metrics['mean_recall']:.2f} %"),
        (
            "zero-shot top-1 / top-5 (colour-shape)",
            "{top1:.2f} / {top5:.2f} %".format(**everything["colour-shape"]),
        ),
        ("mean over suites", f"{everything['mean_over_suites']:.2f}"),
    ]
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
