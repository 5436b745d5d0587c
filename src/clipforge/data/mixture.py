"""The `mixture` source: several sources (data.mixture), each prepared as it would be alone.

Each source is built by its own kind's code (copied or in place, with this section's splits,
filters and limits) into a staging folder, and its splits moved under data/train/<name>/ and
data/val/<name>/. The test set is data.test_dir, or the first source's test split; every source
is checked against it (data.decontaminate): the later ones are built with it as their test_dir,
which is how each kind already checks a given test set, and a `local` source, whose writer takes
no hashes, has its written shards hashed and checked afterwards.

The manifest's train split lists every source's shards one source after the other, and under
`mixture` each source's name, weight, target share, pair count and number of shards: the train
loader draws from them by weight (clipforge.train.order.MixtureOrder).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

from clipforge.data import decontam
from clipforge.data.config import DataConfig, MixtureSource
from clipforge.data.inplace import HELD_SPLITS
from clipforge.data.shards import ShardInfo
from clipforge.data.splits import decontaminate_shards, shard_summary, written_phashes
from clipforge.errors import StageError

STAGING = ".sources"  # out/.sources/<name>/: one source's build, before its splits move

# (one source's DataConfig, its staging folder) -> (splits, source, decontamination)
BuildOne = Callable[[DataConfig, Path], tuple[dict, dict, dict]]


def build_splits(data: DataConfig, out: Path, build_one: BuildOne) -> tuple[dict, dict, dict]:
    """Every source of data.mixture built by `build_one` and merged into out/: (splits, source,
    decontamination) for the manifest."""
    shares = data.mixture_shares()
    test_dir = Path(data.test_dir) if data.test_dir else None
    test_split = None
    built = []
    for i, entry in enumerate(data.mixture):
        root = out / STAGING / entry.name
        root.mkdir(parents=True)
        one = source_config(data, entry, test_dir)
        splits, source, checked = build_one(one, root)
        if entry.source == "local" and data.decontaminate != "off":
            checked = _decontaminate_written(root, splits, test_dir or root / "test", one)
        if splits["train"]["count"] == 0:  # the loader could draw nothing for its share
            raise StageError(
                f"data.mixture[{i}] ({entry.name}): no training pairs after filtering; check its "
                f"path(s) and the skip reasons in the log, or drop it from the mixture"
            )
        if test_dir is None:  # the first source's test split is the mixture's test set
            (root / "test").rename(out / "test")
            test_split, test_dir = splits.pop("test"), out / "test"
        for split in HELD_SPLITS:
            splits[split] = _moved(root, out, split, entry.name, splits[split])
        built.append((entry, splits, source, checked))
    shutil.rmtree(out / STAGING)
    merged = {split: _merged(built, split, shares) for split in HELD_SPLITS}
    if test_split is not None:
        merged["test"] = test_split
    return (
        merged,
        _source_record(built, shares),
        decontam.combined({e.name: c for e, *_, c in built}),
    )


def source_config(data: DataConfig, entry: MixtureSource, test_dir: Path | None) -> DataConfig:
    """The data section as it reads for one source alone: its kind and inputs; after the first,
    the mixture's test set as a given one (checked against, nothing split off)."""
    return dataclasses.replace(
        data,
        source=entry.source,
        path=entry.path,
        paths=list(entry.paths),
        mixture=[],
        test_dir=str(test_dir) if test_dir is not None else None,
    )


def _decontaminate_written(root: Path, splits: dict, test_dir: Path, data: DataConfig) -> dict:
    """A copied source's written train and val shards against the test set (decontaminate_shards,
    as the streaming sources are checked); `splits` updated where `drop` removed samples."""
    shards = {
        split: [ShardInfo(s["name"], s["count"], s["sha256"]) for s in splits[split]["shards"]]
        for split in HELD_SPLITS
    }
    phashes = {
        split: written_phashes(root, infos, data.max_image_pixels)
        for split, infos in shards.items()
    }
    record = decontaminate_shards(root, shards, phashes, test_dir, data)
    for split, infos in shards.items():
        splits[split] = {**splits[split], **shard_summary(infos)}
    return record


def _moved(root: Path, out: Path, split: str, name: str, entry: dict) -> dict:
    """A source's split moved from root/<split>/ to out/<split>/<name>/, its shard names with it."""
    if (root / split).exists():
        (out / split).mkdir(exist_ok=True)
        (root / split).rename(out / split / name)
    prefix = f"{split}/"
    shards = [
        {**s, "name": f"{prefix}{name}/{s['name'].removeprefix(prefix)}"} for s in entry["shards"]
    ]
    return {**entry, "shards": shards}


def _merged(built: list, split: str, shares: dict[str, float]) -> dict:
    """One split of every source: their shards one source after the other, and under `mixture`
    each source's name, pairs, number of shards (where the next source's begin) and whether they are used in
    place; in the train split its weight and share too."""
    shards: list[dict] = []
    parts = []
    for entry, splits, _, _ in built:
        part = {
            "name": entry.name,
            "count": splits[split]["count"],
            "num_shards": len(splits[split]["shards"]),
            "in_place": bool(splits[split].get("in_place")),
        }
        if split == "train":
            part |= {"weight": entry.weight, "share": shares[entry.name]}
        parts.append(part)
        shards += splits[split]["shards"]
    return {
        "count": sum(p["count"] for p in parts),
        "in_place": all(p["in_place"] for p in parts),
        "shards": shards,
        "mixture": parts,
    }


def _source_record(built: list, shares: dict[str, float]) -> dict:
    sources = [
        {
            "name": entry.name,
            "weight": entry.weight,
            "share": shares[entry.name],
            "train": splits["train"]["count"],
            "val": splits["val"]["count"],
            **source,
        }
        for entry, splits, source, _ in built
    ]
    images = [s.get("num_images") for s in sources]
    return {
        "type": "mixture",
        "sources": sources,
        # usable images, where every source counts them (check_held_out_sizes' remedy)
        **({"num_images": sum(images)} if None not in images else {}),
    }
