"""The train stage's params: the `train:` section (TrainConfig) and its batch plan.

The `train:` section (TrainConfig) and the batch arithmetic it
implies (BatchPlan), with the other sections the stage reads (`model`, `alerts`, `storage`) in
TrainParams, and the run id that fingerprints them.

`python -m clipforge.train.config` writes resolved/train.yaml (clipforge.resolve): the
`params-train` stage of dvc.yaml.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from typing import Literal

from clipforge.alerts.config import AlertsConfig
from clipforge.config import Params
from clipforge.fields import MAX_SEED, ConfigError, Section, knob
from clipforge.ids import run_id_for
from clipforge.model.config import ModelConfig
from clipforge.model.files import weights_included
from clipforge.model.names import tower_kinds
from clipforge.store.config import StorageConfig
from clipforge.util import short_repr


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
    loss: Literal["clip", "siglip"] = knob(
        "clip",
        "`clip`: CLIP's softmax contrastive loss (open_clip's ClipLoss); `siglip`: SigLIP's "
        "sigmoid loss (open_clip's SigLipLoss) with its learned bias, the model starting at "
        "SigLIP's temperature 10 and bias -10 (those of the model's config where it has them). "
        "Both are the global batch's loss under accumulation and across ranks.",
    )
    optimizer: Literal["auto", "fused", "torch"] = knob(
        "auto",
        "AdamW implementation: DeepSpeed's fused kernel (`fused`, GPU), torch's (`torch`), "
        "`auto`: fused on GPU, torch on CPU.",
    )
    seed: int = knob(0, "Seed for initialisation, data order and augmentation.", ge=0, le=MAX_SEED)
    lock_image: bool = knob(
        False,
        "Lock the image tower (LiT, open_clip's `lock_image_tower`): its weights stay those of "
        "model.pretrained, bit for bit, and the optimizer holds only the rest.",
    )
    lock_image_unlocked_groups: int = knob(
        0,
        "With lock_image: the image tower's last N layer groups left to train (open_clip's "
        "groups; a ViT's, from the end: the projection, the last block with ln_post, each "
        "earlier block, the stem). A ResNet tower locks whole only.",
        ge=0,
    )
    lock_image_freeze_bn_stats: bool = knob(
        False,
        "With lock_image: fix the BatchNorm running statistics of the locked layers too "
        "(ResNet and timm image towers; a ViT has none).",
    )
    lock_text: bool = knob(
        False,
        "Lock the text tower (open_clip's `lock_text_tower`): its weights stay those of "
        "model.pretrained (a Hugging Face tower: its own) and the optimizer holds only the rest.",
    )
    lock_text_unlocked_layers: int = knob(
        0,
        "With lock_text: the text tower's last N layer groups left to train (open_clip's tower, "
        "from the end: the projection, the last block with ln_final, each earlier block, the "
        "embeddings; a Hugging Face tower: its last N of embeddings + layers, its projection "
        "always trains).",
        ge=0,
    )
    lock_text_freeze_layer_norm: bool = knob(
        True,
        "With lock_text on a Hugging Face tower: lock the LayerNorms of its locked layers too "
        "(false: they train). open_clip's own text tower locks them with the rest, always.",
    )
    distill_model: str | None = knob(
        None,
        "Distil from this teacher (open_clip's DistillClipLoss) as well as from the pairs: any "
        "model eval loads, `local-dir:PATH`, `chinese-clip:PATH`, `hf-hub:ORG/REPO` or an "
        "open_clip name with distill_pretrained. Frozen, outside the optimizer, its features "
        "computed once per micro batch without gradients, in bf16 where the run is bf16 (fp32 "
        "on CPU by default). It sees the student's inputs, so both must preprocess and tokenise "
        "alike (checked at start-up).",
        path=True,
    )
    distill_pretrained: str | None = knob(
        None, "open_clip pretrained tag or file for distill_model.", path=True
    )
    distill_weight: float = knob(
        1.0,
        "With distill_model: the loss is contrastive + distill_weight x distillation (the "
        "cross-entropy of the student's logits to the teacher's; open_clip_train weighs both 1).",
        gt=0.0,
    )
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
        self._check_lock_details()
        self._check_distillation()

    @property
    def locks_a_tower(self) -> bool:
        return self.lock_image or self.lock_text

    def _check_lock_details(self) -> None:
        """A detail of a lock that is off would do nothing, silently: refused, naming both ways
        out (a value differing from the default is a detail set)."""
        details = (
            ("lock_image", "lock_image_unlocked_groups"),
            ("lock_image", "lock_image_freeze_bn_stats"),
            ("lock_text", "lock_text_unlocked_layers"),
            ("lock_text", "lock_text_freeze_layer_norm"),
        )
        defaults = self.defaults()
        for lock, detail in details:
            value = getattr(self, detail)
            if not getattr(self, lock) and value != defaults[detail]:
                raise ConfigError(
                    f"train.{detail}: {str(value).lower()} does nothing while train.{lock} is "
                    f"false; set train.{lock}: true, or train.{detail} back to "
                    f"{str(defaults[detail]).lower()}"
                )

    def _check_distillation(self) -> None:
        """The teacher's details without a teacher, and an architecture without weights (a
        random teacher), refused as eval refuses its baseline's."""
        if self.distill_model is None:
            for detail in ("distill_pretrained", "distill_weight"):
                if getattr(self, detail) != self.defaults()[detail]:
                    raise ConfigError(
                        f"train.{detail}: set only together with train.distill_model (the "
                        f"teacher); set train.distill_model, or remove train.{detail}"
                    )
        elif self.loss == "siglip":
            raise ConfigError(
                "train.distill_model: open_clip's DistillClipLoss distils softmax logits, not "
                "train.loss: siglip's sigmoid ones; set train.loss: clip, or remove "
                "train.distill_model"
            )
        elif not weights_included(self.distill_model) and not self.distill_pretrained:
            raise ConfigError(
                f"train.distill_pretrained: required with train.distill_model "
                f"{short_repr(self.distill_model)}, an open_clip architecture whose weights "
                f"would otherwise be random (a tag such as openai, or a weights file)"
            )


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


def check_one_global_batch(num_samples: int, global_batch_size: int) -> None:
    """ConfigError when the data holds no full global batch: an epoch of no step (the remainder
    of an epoch is dropped, clipforge.util.steps_per_epoch)."""
    if num_samples < global_batch_size:
        raise ConfigError(
            f"train.global_batch_size: {global_batch_size} is larger than the "
            f"{num_samples} training samples in data/; lower it or add data"
        )


def check_tower_locks(model: ModelConfig, train: TrainConfig) -> None:
    """The locks of train.lock_* that cannot do what they say on this model's towers
    (clipforge.model.names.tower_kinds, from its config file), refused in one line each before
    any model is built: open_clip fails on some with a bare assertion and ignores others, and a
    tower locked without model.pretrained would stay random."""
    if not train.locks_a_tower:
        return
    image, text = tower_kinds(model)
    if train.lock_image and image == "resnet" and train.lock_image_unlocked_groups:
        raise ConfigError(
            f"train.lock_image_unlocked_groups: open_clip locks the ResNet image tower of "
            f"{model.name} only whole; set it to 0, or choose a ViT model"
        )
    if train.lock_image_freeze_bn_stats and image == "vit":
        raise ConfigError(
            f"train.lock_image_freeze_bn_stats: the ViT image tower of {model.name} has no "
            f"BatchNorm to freeze; set it to false"
        )
    if train.lock_text and text == "open_clip" and not train.lock_text_freeze_layer_norm:
        raise ConfigError(
            f"train.lock_text_freeze_layer_norm: open_clip locks the LayerNorms of its own text "
            f"tower ({model.name}'s) with the rest; set it to true, or train a Hugging Face "
            f"tower (model.text_tower)"
        )
    random = [
        tower
        for tower, locked in (("image", train.lock_image), ("text", train.lock_text))
        if locked and not model.pretrained and not (tower == "text" and text == "hf")
    ]
    if random:
        raise ConfigError(
            f"train.lock_{random[0]}: would lock the {random[0]} tower of {model.name} at its "
            f"random initialisation (model.pretrained is not set); set model.pretrained to "
            f"trained weights"
        )


@dataclass(kw_only=True)
class TrainParams(Params):
    """What the train stage reads of params.yaml."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        check_tower_locks(self.model, self.train)


# Knobs that change how often things are written or how fast data loads, never the weights.
_NOT_IN_FINGERPRINT = {
    "num_workers",
    "save_every_steps",
    "keep_checkpoints",
    "log_every_steps",
    "val_every_steps",
    "val_retrieval_samples",
}


def run_identity(params: dict) -> dict:
    """The params (as their dict) that name a training run, with its data: `model`, and `train`
    less the knobs that never change the weights. The launcher compares these of two launches.
    Knobs at their defaults are left out, so that a knob a later clipforge adds, at its default,
    names an earlier run as it did (its checkpoints still resume)."""
    train = _chosen(params.get("train"), TrainConfig)
    return {
        "model": _chosen(params.get("model"), ModelConfig),
        "train": {k: v for k, v in train.items() if k not in _NOT_IN_FINGERPRINT},
    }


def _chosen(values: dict | None, section: type[Section]) -> dict:
    """`values` less the knobs of `section` that hold their default."""
    defaults = section.defaults()
    missing = object()
    return {k: v for k, v in (values or {}).items() if defaults.get(k, missing) != v}


def run_id(
    config: TrainParams,
    manifest_bytes: bytes,
    rerun_launch: str | None = None,
    weights_sha256: dict[str, str] | None = None,
) -> str:
    """What determines the result: the data and run_identity's params; the content of the
    weights files the run starts from and learns from, by role (`start`: model.pretrained;
    `teacher`: train.distill_model), since a path names no content (finetune-zh starts from
    lit-zh's export, remade in place when lit-zh is rerun); and for a rerun (`fab rerun`) its
    launch, so that it trains anew rather than resuming the repeated run's checkpoints (the same
    run id otherwise), while a restart of the rerun resumes its own."""
    identity = {
        "data": hashlib.sha256(manifest_bytes).hexdigest(),
        **run_identity(config.to_dict()),
        **(weights_sha256 or {}),
        **({"rerun": rerun_launch} if rerun_launch else {}),
    }
    return run_id_for(identity)


if __name__ == "__main__":
    from clipforge import resolve

    sys.exit(resolve.main("train", TrainParams))
