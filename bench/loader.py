"""The train stage's loader against open_clip's own webdataset pipeline, on the same shards.

    .venv/bin/python bench/loader.py [--images 4096] [--workers 1 2] [--repeats 3]

Both read the same 256 px JPEG shards (generated, as LAION's after img2dataset) and turn them
into training batches of the default model (random resized crop to 64 px; ViT-B/32's 224 px with
--model ViT-B-32): clipforge's MicroBatches (uint8 chunks, normalised later on the device) and
open_clip_train's get_wds_dataset (decode, preprocess to normalised fp32, batch). open_clip's
own function is used when it runs; on webdataset 1.x it does not, and the same stages are then
assembled here from webdataset's public API (the result says which). images/s per core divides
by the worker processes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import _bundle, _dataset, make_shards  # noqa: E402 - the same shards as the GPU bench

BATCH = 256


def clipforge_rate(files, bundle, workers: int, batches: int) -> float:
    from clipforge.config import BatchPlan
    from clipforge.train import data

    plan = BatchPlan(BATCH, BATCH, 1, 1)
    loader = data.micro_batch_loader(
        _dataset(files, bundle, plan, batches + 1), 0, workers, False, 4
    )
    next(loader)  # workers up
    began = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * BATCH / (time.perf_counter() - began)


def open_clip_loader(files, bundle, workers: int):
    """open_clip_train's own get_wds_dataset, or its stages rebuilt on webdataset 1.x."""
    urls = "::".join(str(p) for p in files.paths)
    args = SimpleNamespace(
        train_data=urls,
        train_num_samples=files.num_samples,
        train_data_upsampling_factors=None,
        dataset_resampled=False,
        seed=0,
        batch_size=BATCH,
        workers=workers,
        world_size=1,
    )
    try:
        from open_clip_train import data as oc_data  # imports pandas, which clipforge lacks

        info = oc_data.get_wds_dataset(
            args, bundle.preprocess_train, True, 0, tokenizer=bundle.tokenizer
        )
        return info.dataloader, "open_clip_train.data.get_wds_dataset"
    except Exception as exc:  # noqa: BLE001 - recorded: which pipeline ran and why
        reason = f"{type(exc).__name__}: {exc}"
    import torch
    import webdataset as wds

    pipeline = wds.DataPipeline(
        wds.SimpleShardList([str(p) for p in files.paths]),
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.shuffle(bufsize=1000, initial=1000),
        wds.select(_has_caption_and_image),
        wds.decode("pilrgb"),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=bundle.preprocess_train, text=lambda t: bundle.tokenizer(t)[0]),
        wds.to_tuple("image", "text"),
        wds.batched(BATCH, partial=False),
    )
    loader = torch.utils.data.DataLoader(
        pipeline, batch_size=None, num_workers=workers, persistent_workers=workers > 0
    )
    return loader, f"open_clip's stages on webdataset's API (get_wds_dataset: {reason[:160]})"


def _has_caption_and_image(sample: dict) -> bool:
    """open_clip_train.data.filter_no_caption_or_no_image."""
    has_caption = "txt" in sample
    has_image = "png" in sample or "jpg" in sample or "jpeg" in sample or "webp" in sample
    return has_caption and has_image


def open_clip_rate(files, bundle, workers: int, batches: int) -> tuple[float, str]:
    loader, which = open_clip_loader(files, bundle, workers)
    iterator = iter(loader)
    next(iterator)
    began = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH / (time.perf_counter() - began), which


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="clipforge-tiny")
    args = parser.parse_args(argv)
    from gpu import DRY, Profile

    profile = Profile(**{**DRY.__dict__, "model": args.model, "image_size": None})
    bundle = _bundle(profile)
    # open_clip's pipeline reads each shard once per worker split: enough batches for every
    # worker, one shard per worker at least
    batches = args.images // BATCH - 2 * max(args.workers)
    with tempfile.TemporaryDirectory(prefix="clipforge-loader-bench-") as tmp:
        files = make_shards(Path(tmp), args.images)
        rows, which = [], ""
        for workers in args.workers:
            ours, theirs = [], []
            for repeat in range(args.repeats):
                sides = ["clipforge", "open_clip"][:: 1 if repeat % 2 == 0 else -1]
                for side in sides:  # alternating which goes first
                    if side == "clipforge":
                        ours.append(clipforge_rate(files, bundle, workers, batches))
                    else:
                        theirs.append(open_clip_rate(files, bundle, workers, batches))
            which = theirs[0][1]
            rows.append((workers, statistics.median(ours), statistics.median(r for r, _ in theirs)))
    print(f"{args.images} JPEGs of 256 px, batch {BATCH}, {args.model}, median of {args.repeats}")
    print(f"open_clip side: {which}")
    print("| workers | clipforge images/s | per core | open_clip images/s | per core | ratio |")
    for workers, ours, theirs in rows:
        cores = max(workers, 1)
        print(
            f"| {workers} | {ours:.0f} | {ours / cores:.0f} | {theirs:.0f} | {theirs / cores:.0f} |"
            f" {ours / theirs:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
