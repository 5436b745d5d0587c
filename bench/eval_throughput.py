#!/usr/bin/env python3
"""Images/s of the eval stage's image encoding (clipforge.eval.core.encode_images): decode,
preprocess and encode, each image once, in batches on the device.

    .venv/bin/python bench/eval_throughput.py                      # the demo model, CPU
    .venv/bin/python bench/eval_throughput.py --model ViT-B-32 --device cuda --images 4096

The model has random weights (throughput does not depend on them; nothing is downloaded); the
images are the builtin generator's test scenes, JPEG-encoded at the model's input size, as the
demo's data stage writes them. Each setting runs once to warm up, then `--repeats` times,
the settings taking turns (so that load from other jobs falls on both alike); the best run is
printed (on a shared machine the fastest is the least disturbed). `--serial` also times the same batches with preprocessing on the calling
thread (no prefetch of the next batch), the alternative encode_images replaced. Record the
printed table in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from clipforge.data import builtin  # noqa: E402
from clipforge.eval import core  # noqa: E402


def serial_encode(model, preprocess, images, batch_size, device):
    """encode_images without the prefetch thread: decode and preprocess, then encode."""
    import torch

    chunks = []
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            batch = [core._pixels(preprocess, i) for i in images[start : start + batch_size]]
            pixels = torch.stack(batch).to(device)
            chunks.append(model.encode_image(pixels, normalize=True).float().cpu())
    return torch.cat(chunks)


def best_rates(encodes, model, preprocess, images, batch_size, device, repeats) -> list[float]:
    """Images/s of each encode function, best of `repeats` turns after one warm-up each."""
    import torch

    def once(encode) -> float:
        began = time.perf_counter()
        encode(model, preprocess, images, batch_size, device)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - began

    for encode in encodes:
        once(encode)  # warm-up: allocator, kernels, thread pool
    best = [float("inf")] * len(encodes)
    for _ in range(repeats):
        for n, encode in enumerate(encodes):
            best[n] = min(best[n], once(encode))
    return [len(images) / seconds for seconds in best]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="clipforge-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serial", action="store_true")
    args = parser.parse_args()

    import open_clip
    import torch

    from clipforge.model.names import register_bundled_configs

    register_bundled_configs()
    model, _, preprocess = open_clip.create_model_and_transforms(args.model, device=args.device)
    model.eval()
    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    _, items = builtin.test_images(0, args.images, size)
    images = [item.jpeg for item in items]
    print(
        f"{args.model} ({size} px), {args.images} images, {args.device}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()})"
    )
    print("| batch | images/s (encode_images) |" + (" images/s (serial) |" if args.serial else ""))
    encodes = [core.encode_images, *([serial_encode] if args.serial else [])]
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        row = best_rates(encodes, model, preprocess, images, batch_size, args.device, args.repeats)
        print(f"| {batch_size} | " + " | ".join(f"{r:.0f}" for r in row) + " |")


if __name__ == "__main__":
    main()
