"""The data stage's params: the `data:` section (DataConfig), the only one it reads.

`python -m clipforge.data.config` writes resolved/data.yaml (clipforge.resolve): the `params-data`
stage of dvc.yaml, which depends on this module and no other section's.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Literal

from clipforge import util
from clipforge.config import Params
from clipforge.fields import MAX_SEED, REQUIRED, ConfigError, Entry, Section, knob
from clipforge.model.names import check_model_name

# The smallest share a source of a mixture may have: the train loader deals the mixture out in
# blocks (clipforge.train.order.MIXTURE_BLOCK), in which each source then has at least 16 places.
MIN_SHARE = 0.001
_SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


@dataclass(frozen=True, kw_only=True)
class MixtureSource(Entry):
    """One source of data.mixture: its own inputs, everything else (splits, filters, limits) from
    the data section."""

    name: str = knob(
        REQUIRED,
        "the source's name in the manifest and its folder under data/train and data/val: "
        "letters, digits, `-` and `_`",
    )
    # not builtin: it makes its own test set and eval suites, which no other source has
    source: Literal["local", "laion-parquet", "webdataset"] = knob(
        REQUIRED, "`local`, `laion-parquet` or `webdataset`, as data.source"
    )
    weight: float = knob(
        REQUIRED,
        "its share of the training samples, relative to the other sources' weights",
        gt=0.0,
    )
    path: str | None = knob(None, "local: as data.path", path=True)
    paths: list[str] = knob([], "laion-parquet, webdataset: as data.paths", path=True)

    def check(self, key: str) -> None:
        if not _SOURCE_NAME.fullmatch(self.name):
            raise ConfigError(
                f"{key}.name: got {util.short_repr(self.name)}; must be letters, digits, `-` and "
                f"`_` (it names a folder)"
            )
        if self.source == "local" and not self.path:
            raise ConfigError(
                f"{key}.path: required for a `local` source (a folder, .csv or .jsonl)"
            )
        if self.source != "local" and self.path:
            raise ConfigError(
                f"{key}.path: only for a `local` source; a `{self.source}` source reads `paths`"
            )
        if self.source != "local" and not self.paths:
            raise ConfigError(
                f"{key}.paths: required for a `{self.source}` source (paths, globs or fsspec URLs)"
            )
        if self.source == "local" and self.paths:
            raise ConfigError(f"{key}.paths: not for a `local` source, which reads `path`")


@dataclass(kw_only=True)
class DataConfig(Section):
    SECTION = "data"

    source: Literal["builtin", "local", "laion-parquet", "webdataset", "mixture"] = knob(
        "builtin",
        "Where pairs come from: `builtin` (generated shapes scenes, no download), "
        "`local` (a folder, .csv or .jsonl of image path + caption, see `path`), `laion-parquet` "
        "(LAION-style metadata filtered, then downloaded with img2dataset, see `paths`), "
        "`webdataset` (existing tar shards, see `paths`) or `mixture` (several of those, each "
        "with a weight, see `mixture`).",
    )
    path: str | None = knob(
        None,
        "Input for the `local` source: a folder of images with "
        "same-named .txt captions, a .csv (columns image,caption) or a .jsonl.",
        path=True,
    )
    allow_paths_outside_source: bool = knob(
        False,
        "local: read images a .csv or .jsonl names outside its own folder (`../x.jpg`, absolute "
        "paths); off: such rows are skipped as `outside_source`.",
    )
    paths: list[str] = knob(
        [],
        "Inputs of the `laion-parquet` source (metadata .parquet files) or "
        "of the `webdataset` source (.tar shards): local paths, globs, "
        "`{000..099}` ranges or fsspec URLs such as s3://bucket/laion-zh/*.parquet.",
        path=True,
    )
    mixture: list[MixtureSource] = knob(
        [],
        "With data.source `mixture`: the sources, each `name`, `source` (`local`, "
        "`laion-parquet` or `webdataset`), `path` or `paths` (as data.path, data.paths) and "
        "`weight` (its share of the training samples, relative to the others'). Each is prepared "
        "as it would be alone (with this section's other keys) and checked against the test set "
        "(data.decontaminate); the test set is data.test_dir, or split off the first source. "
        "The train loader draws each position's source by the weights, as a function of the "
        "step. Example: docs/real-data.md.",
    )
    test_dir: str | None = knob(
        None,
        "A test set already in Chinese-CLIP layout (test_imgs.tsv + "
        "test_texts.jsonl), e.g. Flickr30K-CN; copied to data/test instead of "
        "splitting one off the source.",
        path=True,
    )
    seed: int = knob(0, "Seed of the generator and of the split.", ge=0, le=MAX_SEED)
    num_train: int = knob(12000, "builtin: number of training pairs.", ge=1)
    num_val: int = knob(256, "builtin: number of validation pairs.", ge=1)
    num_test_images: int = knob(
        300,
        "builtin: number of test images (two captions each), and of images in each of the "
        "demo's generated eval suites (data/suites/; the classification one: at least one per "
        "class, 24).",
        ge=10,
    )
    image_size: int = knob(64, "builtin: rendered image size in pixels.", ge=32, le=1024)
    val_fraction: float = knob(
        0.02,
        "local, laion-parquet, webdataset: share of images held out for validation.",
        ge=0.0,
        lt=0.5,
    )
    test_fraction: float = knob(
        0.02,
        "local, laion-parquet, webdataset: share of images held out "
        "for the test set (ignored when test_dir is set).",
        ge=0.0,
        lt=0.5,
    )
    samples_per_shard: int = knob(2000, "Samples per webdataset tar shard.", ge=1)
    resize_to: int | None = knob(
        None,
        "Bring every train/val image's shorter side down to this many pixels before sharding "
        "(e.g. 224, ViT-B/32's input): fewer pixels to decode in every epoch, for one lossy "
        "re-encoding; null: keep images as they come.",
        ge=16,
        le=4096,
    )
    max_image_pixels: int = knob(
        50_000_000,
        "Images with more pixels are skipped as `too_large` "
        "(protects against decompression bombs).",
        ge=1,
    )
    max_image_bytes: int = knob(
        64 * 2**20,
        "Image files larger than this many bytes are skipped as `too_large` without being read "
        "(a tar member, a local file; 64 MiB: three times a 50-megapixel camera JPEG), so a "
        "shard declaring a 4 GiB member costs nothing.",
        ge=1,
    )
    max_caption_chars: int = knob(
        512,
        "Captions longer than this are skipped as `caption_too_long`; a caption file or tar "
        "member of more than 4 bytes a character (UTF-8's most) is skipped so without being read.",
        ge=1,
    )
    # the tokenizer named here, not read from the model section: a new model.* then leaves data/
    # (hours to rebuild at the reference size) as it is, and the loader checks the ids it finds
    pretokenize_model: str | None = knob(
        None,
        "Store each train/val caption's token ids with its sample (copied shards: a `tok` member; "
        "in place: the index files), made by the tokenizer of this open_clip model name (as "
        "model.name; its tokenizer only, no weights), so the train loader reads ids instead of "
        "tokenising every caption in every epoch. null: no ids. Set it to the model.name you "
        "train: the loader uses the ids only where the model's tokenizer has the fingerprint "
        "data/manifest.json records (models can share one: ViT-B-32, ViT-B-16), and tokenises "
        "otherwise, saying why. Saves the workers 55-140 µs a caption (2-7% of their time at "
        "224 px; BENCHMARKS.md, loader); the production recipes set their own model.",
        nonempty=True,
        check=check_model_name,
    )
    pretokenize_text_tower: str | None = knob(
        None,
        "With data.pretokenize_model: the Hugging Face text tower whose tokenizer makes the ids "
        "(as model.text_tower; null: the model's own).",
        nonempty=True,
        path=True,
    )
    # webdataset, laion-parquet: shards used where they are (clipforge.data.inplace)
    in_place: bool | Literal["auto"] = knob(
        "auto",
        "webdataset, laion-parquet: index the shards where they are (a local or read-only mount, "
        "an fsspec URL) and train from them, instead of copying them into data/; `auto`: in "
        "place when the shards total 10 GiB or more.",
    )
    verify: Literal["all", "sample", "none"] = knob(
        "sample",
        "In place: images decoded by the data stage to check them: `all`, `sample` (0.1%, by a hash "
        "of the key) or `none`; one found corrupt in training is skipped and counted there.",
    )
    workers: int | Literal["auto"] = knob(
        "auto", "In place: processes indexing shards, one shard each (`auto`: one per CPU).", ge=1
    )
    decontaminate: Literal["drop", "report", "off"] = knob(
        "drop",
        "webdataset, laion-parquet (in place or copied): find test-set images among the train/val "
        "images (exact: decoded pixels; near: 64-bit pHash) and `drop` them, only `report` them "
        "in the manifest, or `off`.",
    )
    decontaminate_max_distance: int = knob(
        6, "Decontamination: pHash bits two images may differ by and still match.", ge=0, le=32
    )
    # laion-parquet: filters on the metadata, applied in this order before anything is downloaded
    min_similarity: float = knob(
        0.32,
        "laion-parquet: keep rows whose CLIP image-text `similarity` is at least this (0: off).",
        ge=0.0,
        le=1.0,
    )
    language: str | None = knob(
        "zh",
        "laion-parquet: keep captions in this language: the "
        "`LANGUAGE` column when present, else script detection (only "
        "`zh`); null: off.",
        nonempty=True,
    )
    max_punsafe: float = knob(
        0.5,
        "laion-parquet: drop rows whose NSFW probability `punsafe` is above this (1: off).",
        ge=0.0,
        le=1.0,
    )
    max_pwatermark: float = knob(
        0.8,
        "laion-parquet: drop rows whose watermark probability `pwatermark` is above this (1: off).",
        ge=0.0,
        le=1.0,
    )
    min_image_side: int = knob(
        64,
        "laion-parquet: drop images whose shorter side is below this "
        "many pixels (metadata WIDTH/HEIGHT, then again once downloaded).",
        ge=0,
    )
    max_aspect_ratio: float = knob(
        3.0,
        "laion-parquet: drop images whose longer side is more than "
        "this many times the shorter (metadata, then once downloaded).",
        ge=1.0,
    )
    dedup_urls: bool = knob(True, "laion-parquet: keep only the first row of each URL.")
    dedup_captions: bool = knob(
        True, "laion-parquet: keep only the first row of each caption (after whitespace clean-up)."
    )
    # laion-parquet: the download (img2dataset, run as a separate tool; see docs/real-data.md)
    download_dir: str = knob(
        "downloads",
        "laion-parquet: where the filtered metadata and "
        "img2dataset's shards are kept between runs, so a rerun continues an "
        "interrupted download (outside data/, which is replaced whole).",
        nonempty=True,
        path=True,
    )
    download_image_size: int = knob(
        256, "laion-parquet: img2dataset resizes images to this size.", ge=16, le=4096
    )
    resize_mode: Literal["no", "border", "keep_ratio", "keep_ratio_largest", "center_crop"] = knob(
        "keep_ratio",
        "laion-parquet: img2dataset's resize mode (`keep_ratio`: shorter side to "
        "download_image_size, aspect kept; `center_crop`: square crop; `border`: pad; `no`).",
    )
    resize_only_if_bigger: bool = knob(True, "laion-parquet: never upscale small images.")
    download_timeout_seconds: int = knob(
        10, "laion-parquet: per-request timeout; a slower server counts as `timeout`.", ge=1
    )
    download_retries: int = knob(2, "laion-parquet: extra attempts for a failed download.", ge=0)
    download_processes: int = knob(
        1, "laion-parquet: img2dataset processes (one shard each at a time).", ge=1
    )
    download_threads: int = knob(32, "laion-parquet: download threads per process.", ge=1)
    download_samples_per_shard: int = knob(
        10000, "laion-parquet: rows per img2dataset shard, the unit of resumption.", ge=1
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.source == "local" and not self.path:
            raise ConfigError(
                "data.path: required when data.source is `local` (a folder, .csv or .jsonl)"
            )
        if self.source in ("laion-parquet", "webdataset") and not self.paths:
            kind = "metadata .parquet files" if self.source == "laion-parquet" else ".tar shards"
            raise ConfigError(
                f"data.paths: required when data.source is `{self.source}` ({kind}: "
                f"paths, globs or fsspec URLs)"
            )
        self._check_mixture()
        if self.pretokenize_text_tower and not self.pretokenize_model:
            raise ConfigError(
                "data.pretokenize_text_tower: needs data.pretokenize_model (the model whose "
                "text tower it replaces, as model.text_tower replaces model.name's)"
            )

    def _check_mixture(self) -> None:
        if self.source != "mixture":
            if self.mixture:
                raise ConfigError(
                    "data.mixture: only read with data.source: mixture; set it, or remove "
                    "data.mixture"
                )
            return
        if len(self.mixture) < 2:
            raise ConfigError(
                f"data.mixture: a mixture needs at least two sources, got {len(self.mixture)}; "
                f"for one, set data.source to its kind"
            )
        for key in ("path", "paths"):
            if getattr(self, key):
                raise ConfigError(
                    f"data.{key}: not read with data.source: mixture; give each source its own "
                    f"in data.mixture"
                )
        if not self.test_dir and not self.test_fraction:
            raise ConfigError(
                "data.test_fraction: 0 with data.source: mixture leaves no test set to check the "
                "sources against; set data.test_dir, or a test_fraction (of the first source)"
            )
        names = [s.name for s in self.mixture]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(
                    f"data.mixture[{i}].name: {name!r} names an earlier source too; names must "
                    f"differ (each is a folder of data/train)"
                )
        total = sum(s.weight for s in self.mixture)
        for i, entry in enumerate(self.mixture):
            if entry.weight / total < MIN_SHARE:
                raise ConfigError(
                    f"data.mixture[{i}].weight: {entry.weight:g} is a share of "
                    f"{entry.weight / total:.2g} of the sum {total:g}; each share must be at "
                    f"least {MIN_SHARE:g} (raise it, or drop the source)"
                )

    def mixture_shares(self) -> dict[str, float]:
        """Each mixture source's target share of the training samples: its normalised weight."""
        total = sum(s.weight for s in self.mixture)
        return {s.name: s.weight / total for s in self.mixture}


@dataclass(kw_only=True)
class DataParams(Params):
    """What the data stage reads of params.yaml."""

    data: DataConfig = field(default_factory=DataConfig)


if __name__ == "__main__":
    from clipforge import resolve

    sys.exit(resolve.main("data", DataParams))
