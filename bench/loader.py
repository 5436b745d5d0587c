"""The train stage's loader against open_clip's own webdataset pipeline, on the same shards.

    .venv/bin/python bench/loader.py [--images 4096] [--workers 1 2] [--repeats 3]

Both read the same 256 px JPEG shards (generated, as LAION's after img2dataset) and turn them
into training batches of the default model (random resized crop to 64 px; ViT-B/32's 224 px with
--model ViT-B-32): clipforge's MicroBatches (uint8 chunks, normalised later on the device) and
open_clip_train's get_wds_dataset (decode, preprocess to normalised fp32, batch). open_clip's
own function is used when it runs; on webdataset 1.x it does not, and the same stages are then
assembled here from webdataset's public API (the result says which). images/s per core divides
by the worker processes.

    .venv/bin/python bench/loader.py --stored-tokens [--model ViT-B-32] [--workers 1 2]

instead times clipforge's loader alone, on the same shards in the same run, with the token ids the
data stage stored (data.pretokenize_model) and tokenising the captions (the reference), for two
tokenizers of Chinese captions: open_clip's (SimpleTokenizer) and a BERT-style Hugging Face one
with a vocabulary the size of hfl/chinese-roberta-wwm-ext's, made here (no download). It also
times each tokenizer alone, per caption, next to the decode of the stored ids.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import (  # noqa: E402 - the same shards as the GPU bench
    _CPUS,
    SHARD_SAMPLES,
    _bundle,
    _dataset,
    _render,
    make_shards,
)

BATCH = 256


def clipforge_rate(files, bundle, workers: int, batches: int) -> float:
    from clipforge.train import loader as data
    from clipforge.train.config import BatchPlan

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
        # its reader breaks on webdataset 1.x (KeyError 'fname') only once iterated
        next(iter(info.dataloader))
        return info.dataloader, "open_clip_train.data.get_wds_dataset"
    except Exception as exc:  # noqa: BLE001 - recorded: which pipeline ran and why
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
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


# -- stored token ids against tokenising in the loader (data.pretokenize_model) -----------------


def bert_zh_tower(directory: Path) -> Path:
    """A BERT-style Chinese tokenizer folder (vocab.txt, tokenizer_config.json, config.json; no
    weights) with about hfl/chinese-roberta-wwm-ext's 21k entries: specials, printable ASCII,
    full-width punctuation and every CJK unified ideograph."""
    import json

    chars = [chr(c) for c in range(0x21, 0x7F)] + list("，。：；！？（）“”")
    chars += [chr(c) for c in range(0x4E00, 0x9FA6)]
    directory.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True})
    )
    (directory / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return directory


def shards_with_tokens(root: Path, triples: list, tokenizer):
    """`triples` as shards with each caption's ids, as the data stage writes them; their
    SplitFiles and TokenFormat."""
    from clipforge.data.shards import CaptionTokenizer, TokenFormat, write_shards
    from clipforge.model.names import tokenizer_fingerprint
    from clipforge.train.loader import SplitFiles

    fingerprint = tokenizer_fingerprint(tokenizer)
    assert fingerprint is not None
    token_format = TokenFormat.for_vocabulary(fingerprint["max_id"], fingerprint["context_length"])
    tokenize = CaptionTokenizer(tokenizer, token_format)
    infos = write_shards(triples, root, "train", SHARD_SAMPLES, tokenize)
    files = SplitFiles([root / i.name for i in infos], [i.count for i in infos])
    return files, token_format


def loader_rate(files, bundle, tokenizer, tokens, workers: int, batches: int) -> float:
    """Images/s of clipforge's loader over `batches` micro-batches of BATCH, after the first.
    workers 0 (the loading in this process, on one torch thread as in a loader worker): images per
    CPU-second of this process, which other jobs on a shared machine disturb less than the wall
    clock (more torch threads would count their busy-waiting)."""
    import torch

    from clipforge.train import loader as data
    from clipforge.train.config import BatchPlan

    plan = BatchPlan(BATCH, BATCH, 1, 1)
    transform = data.uint8_transform(bundle.preprocess_train)[0]
    dataset = data.MicroBatches(files, plan, 0, 0, batches + 1, transform, tokenizer, 64, tokens)
    threads = torch.get_num_threads()
    if workers == 0:
        torch.set_num_threads(1)  # what DataLoader sets in each worker process
    loader = data.micro_batch_loader(dataset, 0, workers, False, 4)
    next(loader)  # workers up
    clock = time.process_time if workers == 0 else time.perf_counter
    began = clock()
    for _ in range(batches):
        next(loader)
    rate = batches * BATCH / (clock() - began)
    torch.set_num_threads(threads)
    del loader
    gc.collect()  # its workers are stopped here, not by a later run's forked worker
    return rate


def per_caption_us(tokenizer, token_format, captions: list[str]) -> tuple[float, float]:
    """µs per caption: the tokenizer on chunks of 64 (as a loader chunk calls it), and the
    decode of the same ids as stored."""
    stored = [
        row
        for i in range(0, 512, 64)
        for row in token_format.encode(tokenizer(captions[i : i + 64]).numpy())
    ]
    timings = []
    for work in (
        lambda: [tokenizer(captions[i : i + 64]) for i in range(0, len(captions), 64)],
        lambda: [token_format.decode(stored[i : i + 64]) for i in range(0, len(stored), 64)],
    ):
        work()
        began = time.perf_counter()
        work()
        timings.append((time.perf_counter() - began) / len(captions) * 1e6)
    return timings[0], timings[1]


def stored_tokens_table(args) -> int:
    from multiprocessing import Pool

    from gpu import DRY, Profile

    from clipforge.model.config import ModelConfig
    from clipforge.model.names import model_tokenizer

    bundle = _bundle(Profile(**{**DRY.__dict__, "model": args.model, "image_size": None}))
    batches = args.images // BATCH - 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="clipforge-loader-bench-") as tmp:
        with Pool(min(16, _CPUS)) as pool:
            triples = pool.map(_render, range(args.images), chunksize=64)
        tower = bert_zh_tower(Path(tmp) / "bert-zh")
        tokenizers = {
            "open_clip SimpleTokenizer": model_tokenizer(ModelConfig(name=args.model)),
            "HF BertTokenizerFast (21k zh vocab)": model_tokenizer(
                ModelConfig(name=args.model, text_tower=str(tower))
            ),
        }
        captions = [caption for _, _, caption in triples[:512]]
        for name, tokenizer in tokenizers.items():
            files, token_format = shards_with_tokens(Path(tmp) / name[:7], triples, tokenizer)
            tokenise_us, decode_us = per_caption_us(tokenizer, token_format, captions)
            for workers in args.workers:
                rates: dict[str, list[float]] = {"stored": [], "tokenised": []}
                for repeat in range(args.repeats):
                    sides = ["stored", "tokenised"][:: 1 if repeat % 2 == 0 else -1]
                    for side in sides:  # alternating which goes first
                        tokens = token_format if side == "stored" else None
                        rates[side].append(
                            loader_rate(files, bundle, tokenizer, tokens, workers, batches)
                        )
                stored, tokenised = (statistics.median(rates[k]) for k in ("stored", "tokenised"))
                rows.append((name, workers, stored, tokenised, tokenise_us, decode_us))
    print(f"{args.images} JPEGs of 256 px, batch {BATCH}, {args.model}, median of {args.repeats}")
    print(
        "| tokenizer | workers | stored ids: images/s | per worker | tokenised: images/s | "
        "per worker | stored / tokenised | tokenise µs/caption | decode stored µs/caption |"
    )
    for name, workers, stored, tokenised, tokenise_us, decode_us in rows:
        cores = max(workers, 1)
        print(
            f"| {name} | {workers or '0 (per CPU-s)'} | {stored:.0f} | {stored / cores:.0f} | {tokenised:.0f} | "
            f"{tokenised / cores:.0f} | {stored / tokenised:.2f}x | {tokenise_us:.0f} | "
            f"{decode_us:.2f} |"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="clipforge-tiny")
    parser.add_argument(
        "--stored-tokens",
        action="store_true",
        help="clipforge's loader with stored token ids against tokenising (data.pretokenize_model)",
    )
    args = parser.parse_args(argv)
    if args.stored_tokens:
        return stored_tokens_table(args)
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
