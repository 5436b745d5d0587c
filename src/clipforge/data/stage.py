"""`python -m clipforge.data`: turn the configured source into data/.

Output layout (written to a temporary sibling and moved into place only when complete, so an
interrupted run leaves the previous data/ intact):
  data/train/shard-NNNNNN.tar   webdataset shards: <key>.jpg + <key>.txt (+ <key>.tok: the
                                caption's token ids, with data.pretokenize_model)
  data/val/shard-NNNNNN.tar
  data/train/<name>/...         data.source: mixture: each source's shards in a folder of its own
  data/val/<name>/...           (clipforge.data.mixture)
  data/test/test_imgs.tsv       Chinese-CLIP layout (see clipforge.data.testset)
  data/test/test_texts.jsonl
  data/suites/<name>/           builtin: the demo's other eval suites (see _builtin_suites)
  data/manifest.json            counts, per-shard sha256, skipped items by reason, source;
                                with data.pretokenize_model, the ids' format and tokenizer
  data/config.yaml              the resolved parameters this data was made with
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from clipforge.cli import (
    exit_on_stop_signals,
    load_stage_config,
    path_argument,
    run_stage,
    stage_parser,
)
from clipforge.data import builtin, decontam, inplace, laion, mixture, testset, wds_source
from clipforge.data.config import DataConfig, DataParams
from clipforge.data.inputs import expand_paths
from clipforge.data.local import load_image, read_records, split_of
from clipforge.data.samples import SizeLimits, SkipLog, clean_caption, shorter_side_at_most
from clipforge.data.shards import CaptionTokenizer, TokenFormat, Tokenize, write_shards
from clipforge.data.splits import SeenPairs, check_given_test_set, check_held_out_sizes
from clipforge.data.splits import shard_summary as _shard_summary
from clipforge.data.splits import test_hashes as _test_hashes
from clipforge.errors import StageError
from clipforge.fields import ConfigError
from clipforge.fsutil import replace_dir_atomically
from clipforge.model.config import ModelConfig
from clipforge.util import short_repr

log = logging.getLogger("clipforge.data")

DATA_MANIFEST = "manifest.json"
SUITES_DIR = "suites"  # builtin: the demo's generated eval suites, data/suites/<name>/
# What this stage reads of params.yaml (dvc.yaml's params: its sections).
PARAMS = DataParams


def build_dataset(config: DataParams, out: Path) -> dict:
    """Write every split of the configured source into the empty directory `out`."""
    data = config.data
    skips = SkipLog()
    tokenize, tokens = caption_tokens(data) if data.pretokenize_model else (None, None)
    if data.source == "mixture":
        splits, source, checked = mixture.build_splits(
            data, out, lambda one, root: source_splits(one, root, skips, tokenize)
        )
    else:
        splits, source, checked = source_splits(data, out, skips, tokenize)
    if splits["train"]["count"] == 0:
        raise StageError(
            f"the train split is empty after filtering ({_skip_text(skips)}); "
            f"check data.path(s) and the skip reasons in the log"
        )
    if data.source != "builtin":  # the built-in source is sized by counts, not fractions
        for warning in check_held_out_sizes(data, splits, source.get("num_images")):
            log.warning("%s", warning)
    if data.test_dir and "test" not in splits:
        splits["test"] = _copy_test_set(Path(data.test_dir), out / "test")
        source["test_set"] = str(data.test_dir)
    manifest = {
        "source": source,
        "splits": splits,
        "skipped": skips.to_dict(),
        "decontamination": checked,
        **({"tokens": tokens} if tokens else {}),
    }
    (out / DATA_MANIFEST).write_text(
        json.dumps(manifest, ensure_ascii=False, indent=2) + "\n", "utf-8"
    )
    (out / "config.yaml").write_text(config.to_yaml(), "utf-8")
    return manifest


def source_splits(
    data: DataConfig, out: Path, skips: SkipLog, tokenize: CaptionTokenizer | None
) -> tuple[dict, dict, dict]:
    """The splits of data.source (one source) written into `out`: (splits, source,
    decontamination) for the manifest."""
    checked = decontam.not_checked("the local source is not checked (data.decontaminate)")
    if data.source == "webdataset":
        files = expand_paths(data.paths, "webdataset .tar shards")
    if data.source == "builtin":
        splits, source = _builtin_splits(data, out, tokenize)
        checked = decontam.not_checked("builtin: test scenes are excluded from train when drawn")
    elif data.source == "laion-parquet":
        splits, source = laion.build_splits(data, out, skips, tokenize)
        checked = source.pop("decontamination", checked)
    elif data.source == "webdataset" and inplace.use_in_place(data, files):
        if data.resize_to:
            log.warning("data.resize_to is not applied in place: images are trained as they are")
        splits, source, checked = inplace.build_splits(data, out, skips, files, tokenize=tokenize)
    elif data.source == "webdataset":
        splits, source = wds_source.build_splits(data, out, skips, files, tokenize)
        checked = source.pop("decontamination")
    else:
        splits, source = _local_splits(data, out, skips, tokenize)
    return splits, source, checked


def caption_tokens(data: DataConfig) -> tuple[CaptionTokenizer, dict]:
    """data.pretokenize_model: that model's tokenizer (built from its name and
    data.pretokenize_text_tower alone, as the train stage builds a model's) as the shard writers'
    `tokenize`, and the manifest's `tokens` entry: how the ids are stored, and the tokenizer's
    fingerprint, which the train loader compares with its model's before it trusts them."""
    from clipforge.model.names import model_tokenizer, tokenizer_fingerprint

    assert data.pretokenize_model is not None
    model = ModelConfig(name=data.pretokenize_model, text_tower=data.pretokenize_text_tower)
    tokenizer = model_tokenizer(
        model, keys=("data.pretokenize_model", "data.pretokenize_text_tower")
    )
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        raise ConfigError(
            f"data.pretokenize_model: the tokenizer of {short_repr(model.name)} "
            f"({type(tokenizer).__name__}) has no vocabulary clipforge can fingerprint, so "
            f"stored ids could not be checked against the model's; set it to null"
        )
    token_format = TokenFormat.for_vocabulary(fingerprint["max_id"], fingerprint["context_length"])
    names = {"model": model.name, "text_tower": model.text_tower}
    log.info(
        "storing token ids of %s's tokenizer (%s, context length %d) with each train/val sample",
        model.text_tower or model.name,
        fingerprint["class"],
        fingerprint["context_length"],
    )
    entry = {**token_format.to_dict(), "tokenizer": {**names, **fingerprint}}
    return CaptionTokenizer(tokenizer, token_format), entry


def _builtin_splits(data: DataConfig, out: Path, tokenize: Tokenize | None) -> tuple[dict, dict]:
    scenes, test_items = builtin.test_images(data.seed, data.num_test_images, data.image_size)
    t2i_scenes, t2i_items = builtin.t2i_suite_images(
        data.seed, data.num_test_images, data.image_size, set(scenes)
    )
    exclude = set(scenes) | set(t2i_scenes)  # no retrieval scene is trained on
    splits = {}
    for split, count in (("train", data.num_train), ("val", data.num_val)):
        triples = (
            (p.key, p.jpeg, p.caption)
            for p in builtin.pairs(data.seed, split, count, data.image_size, exclude)
        )
        resized = ((k, shorter_side_at_most(j, data.resize_to), c) for k, j, c in triples)
        splits[split] = _shard_summary(
            write_shards(resized, out, split, data.samples_per_shard, tokenize)
        )
    if not data.test_dir:
        counts = testset.write_test_set(
            out / "test", ((t.image_id, t.jpeg, t.captions) for t in test_items)
        )
        splits["test"] = {**counts, **_test_hashes(out / "test")}
    source = {
        "type": "builtin",
        "generator": "clipforge.data.builtin",
        "seed": data.seed,
        "image_size": data.image_size,
        "suites": _builtin_suites(data, out / SUITES_DIR, t2i_items),
    }
    return splits, source


def _builtin_suites(data: DataConfig, out: Path, t2i_items) -> dict:
    """The demo's other two eval suites (eval.suites' defaults point at them): a text-to-image
    set with distractors and a zero-shot classification set, as many images as the test set."""
    t2i = out / "t2i-distractors"
    counts = testset.write_test_set(t2i, ((t.image_id, t.jpeg, t.captions) for t in t2i_items))
    classes = testset.write_classification_set(
        out / "colour-shape",
        builtin.CLASS_NAMES,
        builtin.classification_images(
            data.seed, max(data.num_test_images, len(builtin.CLASS_NAMES)), data.image_size
        ),
    )
    classes["sha256"] = testset.classification_set_sha256(out / "colour-shape")
    return {"t2i-distractors": {**counts, **_test_hashes(t2i)}, "colour-shape": classes}


def _local_splits(
    data: DataConfig, out: Path, skips: SkipLog, tokenize: Tokenize | None
) -> tuple[dict, dict]:
    assert data.path is not None  # DataConfig requires it for the local source
    path = Path(data.path)
    if not path.exists():
        raise StageError(
            f"data.path: {path} does not exist (a folder, .csv or .jsonl of image path + caption)"
        )
    held_out = {"val": data.val_fraction, "test": 0.0 if data.test_dir else data.test_fraction}
    buckets: dict[str, list[tuple[str, bytes, str]]] = {"train": [], "val": []}
    test_images: dict[Path, tuple[bytes, list[str]]] = {}
    images = set()
    seen = SeenPairs()
    records = read_records(path, skips, SizeLimits.of(data), data.allow_paths_outside_source)
    for record, jpeg, caption in _valid_pairs(records, data, skips):
        if not seen.first_time(jpeg, caption):
            skips.add("duplicate_pair", record.origin)
            continue
        images.add(record.image)
        split = split_of(record.image, data.seed, held_out["val"], held_out["test"])
        if split == "test":
            test_images.setdefault(record.image, (jpeg, []))[1].append(caption)
        else:
            jpeg = shorter_side_at_most(jpeg, data.resize_to)
            buckets[split].append((f"{split}-{len(buckets[split]):08d}", jpeg, caption))
    if seen.warning():
        log.warning("%s", seen.warning())
    splits = {
        split: _shard_summary(write_shards(items, out, split, data.samples_per_shard, tokenize))
        for split, items in buckets.items()
    }
    if not data.test_dir:
        items = ((i, jpeg, caps) for i, (jpeg, caps) in enumerate(test_images.values()))
        splits["test"] = {
            **testset.write_test_set(out / "test", items),
            **_test_hashes(out / "test"),
        }
    source = {"type": "local", "path": str(path), "seed": data.seed, "num_images": len(images)}
    return splits, source


def _valid_pairs(records, data: DataConfig, skips: SkipLog) -> Iterator[tuple]:
    last: tuple[Path, bytes | None, str | None] = (Path(), None, None)
    for record in records:
        caption, reason = clean_caption(record.caption, data.max_caption_chars)
        if reason:
            skips.add(reason, record.origin)
            continue
        if record.image != last[0]:  # consecutive captions of one image decode it once
            last = (
                record.image,
                *load_image(record.image, data.max_image_pixels, SizeLimits.of(data)),
            )
        _, jpeg, reason = last
        if reason:
            skips.add(reason, str(record.image))
            continue
        yield record, jpeg, caption


def _copy_test_set(source: Path, target: Path) -> dict:
    try:
        given = testset.load_test_set(source)
    except testset.TestSetError as exc:
        raise StageError(
            "\n".join(f"data.test_dir: {line}" for line in str(exc).splitlines())
        ) from None
    counts = given.counts()
    for warning in check_given_test_set(given.direction_sizes()):
        log.warning("%s", warning)
    target.mkdir(parents=True)
    for name in (testset.IMAGES_FILE, testset.TEXTS_FILE):
        shutil.copyfile(source / name, target / name)
    return {**counts, **_test_hashes(target)}


def _skip_text(skips: SkipLog) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(skips.counts.items())) or "nothing skipped"


def _run(args) -> None:
    config = load_stage_config(args, PARAMS)
    out = Path(args.out)
    given = [("data.path", config.data.path), ("data.test_dir", config.data.test_dir)]
    given += [(f"data.mixture[{i}].path", s.path) for i, s in enumerate(config.data.mixture)]
    for key, value in given:
        if value and Path(value).resolve().is_relative_to(out.resolve()):
            raise StageError(
                f"{key}: {value} is inside the output directory {out}, which the "
                f"stage replaces; keep source data elsewhere (e.g. datasets/)"
            )
    # SIGTERM (a stopped `dvc repro`, a scheduler) ends the stage through SystemExit, so the
    # half-written output is removed on the way out, as on any error.
    with exit_on_stop_signals(), replace_dir_atomically(out) as tmp:
        manifest = build_dataset(config, tmp)
    splits = manifest["splits"]
    log.info(
        "wrote %s: train %d, val %d, test %d images / %d texts; skipped: %s",
        out,
        splits["train"]["count"],
        splits["val"]["count"],
        splits["test"]["images"],
        splits["test"]["texts"],
        _skip_text_from(manifest),
    )


def _skip_text_from(manifest: dict) -> str:
    counts = manifest["skipped"]["counts"]
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


def main(argv: Sequence[str] | None = None) -> int:
    parser = stage_parser("clipforge.data", "Build webdataset shards and the test set in data/.")
    parser.add_argument(
        "--out", type=path_argument, default="data", help="output directory (default: data)"
    )
    return run_stage("clipforge.data", _run, argv, parser, PARAMS)
