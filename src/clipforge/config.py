"""Typed parameters: params.yaml -> recipe -> --set overrides -> validated dataclasses.

Every knob is a field of one of the section dataclasses below, with its documentation, its
default (the embedded CPU default) and its allowed range. `load_config` is the only way stages
get their configuration, so every check here runs before any heavy import or file write. A stage
loads only the sections it reads: a bad `train.*` value stops the train stage, not the data
stage; unknown keys and YAML errors stop every stage.

Layering, lowest first:
  1. the embedded default (the field defaults below: a tiny model that trains in minutes on CPU);
  2. the recipe named by the top-level `recipe` key (`clipforge.recipes`): a different set of
     defaults, e.g. the production ViT-B/32 run;
  3. params.yaml: a key whose value differs from the embedded default is the user's choice and
     wins over the recipe (so `dvc exp run -S recipe=production -S train.lr=1e-4` does what it says);
  4. `--set section.key=value` (YAML-parsed, like `dvc exp run -S`).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from clipforge import util
from clipforge.alerts.config import AlertsConfig
from clipforge.fields import REQUIRED, ConfigError, Entry, Section, knob
from clipforge.model_names import check_model_name
from clipforge.recipes import RECIPES_DOC
from clipforge.store.config import StorageConfig
from clipforge.yamlfile import YamlFileError, load_yaml, read_yaml_file

# The largest seed: torch.manual_seed takes 0..2**64-1 (a larger one failed after the whole
# start-up); numpy's generators, seeded with [seed, ...] lists, take any size. One range for every
# seed knob.
MAX_SEED = 2**64 - 1


@dataclass(kw_only=True)
class DataConfig(Section):
    SECTION = "data"

    source: Literal["builtin", "local", "laion-parquet", "webdataset"] = knob(
        "builtin",
        "Where pairs come from: `builtin` (generated shapes scenes, no download), "
        "`local` (a folder, .csv or .jsonl of image path + caption, see `path`), `laion-parquet` "
        "(LAION-style metadata filtered, then downloaded with img2dataset, see `paths`) or "
        "`webdataset` (existing tar shards, see `paths`).",
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
        if self.pretokenize_text_tower and not self.pretokenize_model:
            raise ConfigError(
                "data.pretokenize_text_tower: needs data.pretokenize_model (the model whose "
                "text tower it replaces, as model.text_tower replaces model.name's)"
            )


@dataclass(kw_only=True)
class ModelConfig(Section):
    SECTION = "model"

    name: str = knob(
        "clipforge-tiny",
        "open_clip model name (`ViT-B-32`, any open_clip config, or a "
        "bundled clipforge config such as `clipforge-tiny`).",
        nonempty=True,
        check=check_model_name,
    )
    pretrained: str | None = knob(
        None,
        "Initial weights: an open_clip checkpoint file "
        "(.safetensors, or a .pt/.bin loaded with weights_only) or "
        "`local-dir:PATH` of an exported model.",
        path=True,
    )
    text_tower: str | None = knob(
        None,
        "Replace the text tower with a Hugging Face model (hub id or "
        "local folder), e.g. `hfl/chinese-roberta-wwm-ext`; its tokenizer "
        "is used too.",
        path=True,
    )
    image_size: int | None = knob(
        None, "Override the model's input image size (null: the model's own).", ge=16, le=1024
    )
    patch_dropout: float = knob(
        0.0,
        "FLIP-style patch dropout: the share of image patches dropped in training (0: none; "
        "0.5 about halves the image tower's cost per sample, at some recall per step). Training "
        "only: evaluation and the export see every patch.",
        ge=0.0,
        lt=1.0,
    )


@dataclass(kw_only=True)
class TrainConfig(Section):
    SECTION = "train"

    device: Literal["auto", "cpu", "cuda"] = knob("auto", "`auto`: CUDA when available, else CPU.")
    precision: Literal["auto", "bf16", "fp32"] = knob(
        "auto",
        "`auto`: bf16 on GPUs that have it, fp32 on CPU; `bf16` runs on CPU too (slower there).",
    )
    zero_stage: int = knob(
        1,
        "DeepSpeed ZeRO stage. The gradients are the same at every stage; higher stages save "
        "memory at the cost of communication (production: 1; production-large: 3).",
        ge=0,
        le=3,
    )
    num_nodes: int = knob(1, "Machines in the run.", ge=1)
    ranks_per_node: int = knob(1, "Processes per machine: GPUs per node, or CPU ranks.", ge=1)
    global_batch_size: int = knob(
        128, "Contrastive batch: pairs per optimizer step over all ranks.", ge=2
    )
    micro_batch_size: int | Literal["auto"] = knob(
        "auto",
        "Pairs per forward pass on one rank (`auto`: the rank's whole share of the global batch, "
        "global / (world size x accumulation), on CPU; on GPUs the largest that fits in memory, "
        "found by a short probe at start-up).",
        ge=1,
    )
    grad_accum_steps: int | Literal["auto"] = knob(
        "auto",
        "Micro-batches per rank per step, with feature caching (`auto`: global batch / "
        "(micro batch x world size)).",
        ge=1,
    )
    epochs: int = knob(1, "Passes over the training set.", ge=1)
    max_steps: int | None = knob(
        None,
        "Stop after this many optimizer steps (null: epochs decide); "
        "the schedule still spans max_steps.",
        ge=1,
    )
    lr: float = knob(1e-3, "Peak learning rate.", gt=0.0)
    warmup_steps: int = knob(20, "Linear warm-up steps before cosine decay.", ge=0)
    min_lr_ratio: float = knob(0.0, "Final lr as a fraction of the peak.", ge=0.0, le=1.0)
    beta1: float = knob(0.9, "AdamW beta1.", ge=0.0, lt=1.0)
    beta2: float = knob(0.98, "AdamW beta2.", ge=0.0, lt=1.0)
    eps: float = knob(1e-6, "AdamW epsilon.", gt=0.0)
    weight_decay: float = knob(
        0.2,
        "AdamW weight decay; not applied to gains, biases, 1-d embeddings or logit_scale.",
        ge=0.0,
    )
    grad_clip_norm: float = knob(1.0, "Clip gradients to this global norm (0: off).", ge=0.0)
    max_logit_scale: float = knob(100.0, "Cap on the learned temperature exp(logit_scale).", gt=1.0)
    optimizer: Literal["auto", "fused", "torch"] = knob(
        "auto",
        "AdamW implementation: DeepSpeed's fused kernel (`fused`, GPU), torch's (`torch`), "
        "`auto`: fused on GPU, torch on CPU.",
    )
    seed: int = knob(0, "Seed for initialisation, data order and augmentation.", ge=0, le=MAX_SEED)
    num_workers: int = knob(1, "Data-loading processes per rank.", ge=0)
    decode_on_device: bool = knob(
        False,
        "Decode the JPEGs on the GPU (batched nvjpeg) and crop and resize them there; the "
        "loader workers only read bytes and draw each crop. CUDA only; open_clip's default "
        "training transform only. Measured in BENCHMARKS.md (GPU benchmark, loader section).",
    )
    shuffle_window_shards: int = knob(
        64,
        "Shards whose samples are shuffled together each epoch (windows of the shuffled shard "
        "order): more mixes each batch's negatives better, at more open files per loader worker.",
        ge=1,
    )
    compile: bool = knob(
        False, "torch.compile the model (GPU; measured in BENCHMARKS.md before turning it on)."
    )
    grad_checkpointing: bool = knob(
        False,
        "Recompute activations in backward instead of keeping them (open_clip's gradient "
        "checkpointing): less memory for a larger micro batch, about a third more compute.",
    )
    save_every_steps: int = knob(
        50, "Checkpoint interval in optimizer steps (a final one is always saved).", ge=1
    )
    keep_checkpoints: int = knob(2, "Checkpoints kept per run (older ones are deleted).", ge=1)
    log_every_steps: int = knob(10, "Interval of log lines, TensorBoard and metrics rows.", ge=1)
    val_every_steps: int | None = knob(
        20,  # the demo's ~90 steps: a validation curve of several points, not one dot
        "Validation (loss and retrieval recall, TensorBoard "
        "`val/*`) every this many steps, besides epoch ends "
        "(null: epoch ends only).",
        ge=1,
    )
    val_retrieval_samples: int = knob(
        1000,
        "Validation pairs ranked for `val/t2i_r01`... (the "
        "gallery size: recall falls as it grows, so keep it fixed "
        "to compare runs).",
        ge=2,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        batch_plan(self)  # raises on inconsistent batch arithmetic
        if self.warmup_steps and self.max_steps and self.warmup_steps >= self.max_steps:
            raise ConfigError(
                f"train.warmup_steps: got {self.warmup_steps}; must be < "
                f"train.max_steps ({self.max_steps})"
            )


SUITE_KINDS = ("retrieval", "zero-shot-classification")
# Keys of metrics/eval.json beside the suites' names (clipforge.eval.stage): no suite is called so.
RESERVED_SUITE_NAMES = ("baseline", "delta", "mean_over_suites")
_SUITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


@dataclass(frozen=True, kw_only=True)
class SuiteConfig(Entry):
    """One test set of eval.suites (clipforge.eval.suites reads it)."""

    name: str = knob(
        REQUIRED,
        "the suite's key in metrics/eval.json: letters, digits, `-` and `_` (no dots: DVC "
        "joins nested keys with them)",
    )
    kind: Literal["retrieval", "zero-shot-classification"] = knob(
        REQUIRED, "`retrieval` or `zero-shot-classification`"
    )
    path: str = knob(
        REQUIRED,
        "retrieval: a folder in Chinese-CLIP layout (test_imgs.tsv + test_texts.jsonl); "
        "classification: a folder with a folder of images per class, or a .tsv of "
        "`image<TAB>label` lines (image paths relative to the .tsv)",
        nonempty=True,
        path=True,
    )
    required: bool = knob(
        True, "a missing path stops the stage before any model loads; false: skipped, one line"
    )
    directions: Literal["both", "t2i"] = knob(
        "both", "retrieval: `both`, or `t2i` for a text-to-image-only set such as MUGE's"
    )
    classes: str | None = knob(
        None,
        "classification: a file of class names, one per line; labels (folder names or the "
        ".tsv's) are then 0-based line numbers, as in Chinese-CLIP's `000/` folders and "
        "label_cn.txt; null: the labels are the class names",
        path=True,
    )
    templates: str | None = knob(
        None,
        "classification: a file of prompt templates, one per line, each with one `{}` for the "
        "class name (`#` lines are comments); null: clipforge's Chinese set "
        "(clipforge/eval/templates_zh.txt)",
        path=True,
    )

    def check(self, key: str) -> None:
        if not _SUITE_NAME.fullmatch(self.name) or self.name in RESERVED_SUITE_NAMES:
            raise ConfigError(
                f"{key}.name: got {util.short_repr(self.name)}; must be letters, digits, `-` and "
                f"`_`, and none "
                f"of {', '.join(RESERVED_SUITE_NAMES)}"
            )
        if self.kind == "retrieval":
            for name in ("classes", "templates"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{key}.{name}: only for kind zero-shot-classification")
        elif self.directions != "both":
            raise ConfigError(f"{key}.directions: only for kind retrieval")


# The demo's suites: the data stage's test split, and the builtin source's two generated suites
# (clipforge.data.builtin), optional since other sources do not make them.
# Keys left out take their defaults; params.yaml spells them out (a value equal to the embedded
# default is what lets a recipe's suites apply).
DEMO_SUITES = [
    {"name": "test", "kind": "retrieval", "path": "data/test"},
    {
        "name": "t2i-distractors",
        "kind": "retrieval",
        "path": "data/suites/t2i-distractors",
        "directions": "t2i",
        "required": False,
    },
    {
        "name": "colour-shape",
        "kind": "zero-shot-classification",
        "path": "data/suites/colour-shape/test",
        "classes": "data/suites/colour-shape/label_cn.txt",
        "required": False,
    },
]


@dataclass(kw_only=True)
class EvalConfig(Section):
    SECTION = "eval"

    suites: list[SuiteConfig] = knob(
        DEMO_SUITES,
        "The test sets, each scored under its name in metrics/eval.json, with one mean over "
        "them. Each entry: `name`, `kind` (`retrieval`: Chinese-CLIP layout; "
        "`zero-shot-classification`: a folder per class or an `image<TAB>label` .tsv), `path`, "
        "`required` (false: a missing path is skipped with one line), `directions` (retrieval: "
        "`both` or `t2i`), `classes` and `templates` (classification: files of class names and "
        "of prompts with `{}`; null templates: clipforge's Chinese set). Keys and layouts: "
        "docs/pipeline.md.",
    )
    batch_size: int = knob(256, "Images or texts per encoding batch.", ge=1)
    device: Literal["auto", "cpu", "cuda"] = knob("auto", "`auto`: CUDA when available, else CPU.")
    baseline_model: str | None = knob(
        None,
        "Also evaluate this model for comparison: `local-dir:PATH`, `hf-hub:ORG/REPO`, "
        "`chinese-clip:PATH` (a Chinese-CLIP .pt or ChineseCLIPModel folder) or an open_clip "
        "name (with baseline_pretrained).",
        path=True,
    )
    baseline_pretrained: str | None = knob(
        None, "open_clip pretrained tag or file for baseline_model.", path=True
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.suites:
            raise ConfigError("eval.suites: must list at least one test set")
        names = [suite.name for suite in self.suites]
        again = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if again:
            raise ConfigError(
                f"eval.suites: two suites are named {util.short_repr(again)}; names must be unique"
            )
        if self.baseline_pretrained and not self.baseline_model:
            raise ConfigError(
                "eval.baseline_pretrained: set only together with eval.baseline_model"
            )
        if (
            self.baseline_model
            and not weights_included(self.baseline_model)
            and not self.baseline_pretrained
        ):
            raise ConfigError(
                f"eval.baseline_pretrained: required with eval.baseline_model "
                f"{util.short_repr(self.baseline_model)}, an open_clip architecture whose "
                f"weights would "
                f"otherwise be random (a tag such as openai, or a weights file)"
            )


def weights_included(model: str) -> bool:
    """Does a model spec bring its weights (`local-dir:`, `hf-hub:`, `chinese-clip:`)? A bare
    name is an open_clip architecture: without pretrained weights, a random model."""
    return model.startswith(("local-dir:", "hf-hub:", "chinese-clip:"))


@dataclass(kw_only=True)
class Config:
    """The resolved params. A config loaded for one stage holds the sections that stage reads; the
    others are None (and left out of to_dict and to_yaml)."""

    recipe: str = knob("default", RECIPES_DOC)  # each recipe's gist, read off the recipe
    data: DataConfig | None = field(default_factory=DataConfig)
    model: ModelConfig | None = field(default_factory=ModelConfig)
    train: TrainConfig | None = field(default_factory=TrainConfig)
    eval: EvalConfig | None = field(default_factory=EvalConfig)
    alerts: AlertsConfig | None = field(default_factory=AlertsConfig)
    storage: StorageConfig | None = field(default_factory=StorageConfig)

    def to_dict(self) -> dict:
        return {
            name: value for name, value in dataclasses.asdict(self).items() if value is not None
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "recipe"}
# The sections each pipeline stage reads, besides `recipe`: all it loads and checks.
STAGE_SECTIONS = {
    "data": ("data",),
    "train": ("model", "train", "alerts", "storage"),
    "eval": ("eval",),
}
_SECTION_TYPES = {
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "alerts": AlertsConfig,
    "storage": StorageConfig,
}


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(
    params_path: str | Path | None = "params.yaml",
    overrides: Sequence[str] = (),
    sections: Sequence[str] = tuple(SECTIONS),
) -> Config:
    """Read params, apply recipe and overrides, validate; raise ConfigError naming the key.
    Only `sections` are built and checked (the rest are None); unknown keys fail in any section."""
    raw = _read_params(params_path) if params_path is not None else {}
    forced: dict = {}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(forced, key, value)
    return resolve(raw, forced, sections)


def resolve(
    raw: dict, forced: dict | None = None, sections: Sequence[str] = tuple(SECTIONS)
) -> Config:
    """params mapping (+ `forced` values that always win, e.g. --set) -> validated Config."""
    from clipforge.recipes import RECIPES

    forced = forced or {}
    for name, mapping in (("params", raw), ("overrides", forced)):
        if not isinstance(mapping, dict):
            raise ConfigError(f"{name} must be a mapping of sections, got {type(mapping).__name__}")
        known = {"recipe", *SECTIONS}
        _check_names(name, mapping)
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ConfigError(
                f"unknown top-level key {util.short_repr(unknown[0])}: allowed are {sorted(known)}"
            )
    recipe = forced.get("recipe", raw.get("recipe", "default"))
    if not isinstance(recipe, str):
        raise ConfigError(
            f"recipe: got {util.short_repr(recipe)}; must be the name of a recipe: "
            f"{sorted(RECIPES)}"
        )
    if recipe not in RECIPES:
        raise ConfigError(
            f"recipe: unknown recipe {util.short_repr(recipe)}: allowed are {sorted(RECIPES)}"
        )

    embedded = Config().to_dict()
    merged = copy.deepcopy(embedded)
    for section, values in RECIPES[recipe].items():
        merged[section].update(values)
    for section in SECTIONS:
        recipe_keys = RECIPES[recipe].get(section, {})
        for key, value in _section_items(raw, section, embedded):
            # A value still equal to the embedded default is not a choice: the recipe's applies.
            if key not in recipe_keys or not _is_embedded_default(section, key, value, embedded):
                merged[section][key] = value
        for key, value in _section_items(forced, section, embedded):
            merged[section][key] = value

    built = {
        name: _SECTION_TYPES[name](**merged[name]) if name in sections else None
        for name in SECTIONS
    }  # each section checks itself on construction
    return Config(recipe=recipe, **built)


def _is_embedded_default(section: str, key: str, value: Any, embedded: dict) -> bool:
    """Is `value` the embedded default, also when written shorter: a list of entries (eval.suites)
    whose entries leave out keys at their defaults is the same list."""
    if value == embedded[section][key]:
        return True
    if not isinstance(value, list):
        return False
    try:
        built = _SECTION_TYPES[section](**{key: value})
    except ConfigError:
        return False  # not the default, and an error the section reports when it is built
    return dataclasses.asdict(built)[key] == embedded[section][key]


def _check_names(where: str, mapping: dict) -> None:
    """Keys are names: a YAML key like `1:` or `true:` would otherwise fail far from here."""
    for key in mapping:
        if not isinstance(key, str):
            raise ConfigError(
                f"{where}: key {util.short_repr(key)} is not a name; keys are words like `train`"
            )


def _section_items(mapping: dict, section: str, embedded: dict) -> list[tuple[str, Any]]:
    values = mapping.get(section)
    if values is None:  # `train:` with nothing under it: an empty section
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{section}: must be a mapping of keys, got {util.short_repr(values)}")
    _check_names(section, values)
    for key in values:
        if key not in embedded[section]:
            raise ConfigError(
                f"{section}.{key}: unknown key; {section} has: {', '.join(embedded[section])}"
            )
    return list(values.items())


def parse_override(item: str) -> tuple[str, Any]:
    """`train.lr=1e-4` -> ("train.lr", 0.0001). The value is YAML, as with `dvc exp run -S`."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(
            f"--set {util.short_repr(item)}: expected section.key=value, e.g. train.lr=1e-4"
        )
    try:
        value = load_yaml(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--set {util.short_repr(item)}: value is not valid YAML ({_yaml_problem(exc)})"
        ) from None
    return key.strip(), value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What a parser error says, without its position (a --set value is one short line)."""
    return getattr(exc, "problem", None) or util.first_line(exc)


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) == 1 and parts[0] == "recipe":
        raw["recipe"] = value
        return
    if len(parts) != 2:
        raise ConfigError(f"--set {key}: expected section.key (sections: {', '.join(SECTIONS)})")
    section, name = parts
    if section not in SECTIONS:
        raise ConfigError(
            f"--set {key}: unknown section {util.short_repr(section)}; sections: "
            f"{', '.join(SECTIONS)}"
        )
    raw.setdefault(section, {})
    if raw[section] is None:
        raw[section] = {}
    raw[section][name] = value


def _read_params(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"params file {path} not found: run from the project root or pass --params"
        )
    try:
        raw = read_yaml_file(path)
    except YamlFileError as exc:
        raise ConfigError(str(exc)) from None
    # A file that sets nothing is a mistake (a truncated copy, a wrong --params), not a request
    # for the embedded defaults: running on them would give a result nobody asked for.
    if raw is None or raw == {}:
        raise ConfigError(
            f"{path}: sets no parameters; write at least `recipe: default` to run on the "
            f"embedded defaults"
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: must be a mapping of sections (recipe, {', '.join(SECTIONS)}), "
            f"got a {type(raw).__name__}"
        )
    return raw


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    world_size: int


def batch_plan(
    train: TrainConfig, world_size: int | None = None, micro_batch_size: int | None = None
) -> BatchPlan:
    """global batch = micro batch x accumulation x world size, naming every factor when it is not.

    The global batch is the choice that holds; `auto` factors follow from it. `micro_batch_size`
    is what a memory probe chose for `train.micro_batch_size: auto` (None: no probe, so the
    rank's whole share of the global batch, divided by an explicit accumulation)."""
    world = world_size if world_size is not None else train.num_nodes * train.ranks_per_node
    world_text = (
        f"world size {world} (train.num_nodes={train.num_nodes} x "
        f"train.ranks_per_node={train.ranks_per_node})"
    )
    if train.micro_batch_size == "auto" and micro_batch_size is None:
        return _share_of_each_rank(train, world, world_text)
    micro = micro_batch_size if train.micro_batch_size == "auto" else train.micro_batch_size
    assert micro is not None  # `auto` without a probe returned above
    factors = f"train.micro_batch_size={micro} x {world_text}"
    per_step = micro * world
    if train.grad_accum_steps == "auto":
        if train.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size: {train.global_batch_size} is not a multiple of "
                f"{factors} = {per_step}; change one of them"
            )
        accum = train.global_batch_size // per_step
    else:
        accum = train.grad_accum_steps
        if per_step * accum != train.global_batch_size:
            raise ConfigError(
                f"train.global_batch_size: {train.global_batch_size} != {factors} x "
                f"train.grad_accum_steps={accum} = {per_step * accum}; change one of them or set "
                f"train.grad_accum_steps: auto"
            )
    return BatchPlan(train.global_batch_size, micro, accum, world)


def reshaped_plan(planned: BatchPlan, world_size: int) -> BatchPlan:
    """The plan of a run going on at `world_size` ranks instead of its planned ones (a GPU lost,
    or back): the same global batch, so the same maths, and the same micro batch (what fits in a
    GPU's memory); the accumulation follows."""
    per_step = planned.micro_batch_size * world_size
    if planned.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size: {planned.global_batch_size} is not a multiple of micro "
            f"batch {planned.micro_batch_size} x {world_size} ranks left = {per_step}: the run "
            f"cannot go on at this world size with the same global batch"
        )
    return BatchPlan(
        planned.global_batch_size,
        planned.micro_batch_size,
        planned.global_batch_size // per_step,
        world_size,
    )


def _share_of_each_rank(train: TrainConfig, world: int, world_text: str) -> BatchPlan:
    """`micro_batch_size: auto` without a probe: each rank's share in `accum` forward passes."""
    accum = 1 if train.grad_accum_steps == "auto" else train.grad_accum_steps
    per_pass = world * accum
    if train.global_batch_size % per_pass:
        accum_text = "" if accum == 1 else f" x train.grad_accum_steps={accum} = {per_pass}"
        raise ConfigError(
            f"train.global_batch_size: {train.global_batch_size} is not a multiple of "
            f"{world_text}{accum_text}; choose a global batch that is"
        )
    return BatchPlan(train.global_batch_size, train.global_batch_size // per_pass, accum, world)


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Full global batches per epoch (clipforge.util.steps_per_epoch); ConfigError when none."""
    steps = util.steps_per_epoch(num_samples, global_batch_size)
    if steps == 0:
        raise ConfigError(
            f"train.global_batch_size: {global_batch_size} is larger than the "
            f"{num_samples} training samples in data/; lower it or add data"
        )
    return steps


def field_docs(cls: type = Config, prefix: str = "") -> dict[str, str]:
    """Dotted key -> documentation, for every knob (used to check params.yaml is documented)."""
    docs = {}
    for f in dataclasses.fields(cls):
        if f.name in _SECTION_TYPES:
            docs.update(field_docs(_SECTION_TYPES[f.name], f"{f.name}."))
        else:
            docs[prefix + f.name] = f.metadata["doc"]
    return docs
