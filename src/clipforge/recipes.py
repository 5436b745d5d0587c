"""Named sets of params: what `python -m clipforge.pipeline.recipe NAME` writes into params.yaml.

`default` is the embedded default itself (the field defaults of each section): a tiny model
on the built-in dataset that trains in minutes on 2 CPU cores. `production` is the reference run:
open_clip ViT-B/32 at 224 px on the LAION-5B Chinese subset (metadata filtered to CLIP
similarity >= 0.32, downloaded with img2dataset), DeepSpeed in bf16 on 4 GPUs, global batch 4096,
lr 5e-4 with 500 warm-up steps and cosine decay over 42k steps, evaluated on Flickr30K-CN.

The ZeRO stage changes memory and speed, never the gradients
(tests/train/test_accumulation.py), so `production` takes the fastest stage that fits. That
choice rests on analysis (bench/gpu.py measures stages 1-3 on a GPU; BENCHMARKS.md has its results
once run there): ViT-B/32 has 151M parameters, whose weights, fp32 gradients and AdamW states take
about 1.7 GB per GPU under ZeRO-1 (2% of an 80 GB GPU), and ZeRO-1 communicates least: once per
step, like plain data parallelism. ZeRO-2 also reduces gradients in every micro-batch's backward,
and ZeRO-3 gathers the weights on each of the three passes per micro-batch (cached forward, forward,
backward), invalidating its prefetch trace as no-grad and grad passes alternate. ZeRO-3 stays one
`--set train.zero_stage=3` away. `production-large` (ViT-bigG-14, 2.5B parameters) is the recipe
that uses ZeRO-3: its model states take 26 GiB per GPU under ZeRO-1, 15 under ZeRO-2 and 11 under
ZeRO-3 (DeepSpeed's estimator; tests/test_recipes.py), and every GB goes to activations, with
gradient checkpointing on. The two `production-*` variants swap the text tower for one that reads
Chinese natively: `hfl/chinese-roberta-wwm-ext` with its own tokenizer (as Chinese-CLIP does), or
open_clip's `xlm-roberta-base-ViT-B-32`. `lit-zh` starts from open weights instead of from
scratch (a file in `model.pretrained`, LIT_ZH_WEIGHTS) and locks their image tower
(train.lock_image): it trains only the text tower and the temperature, for a quarter of
production's steps; its cost and what it should reach are in docs/real-data.md. `finetune-zh`
is Chinese-CLIP's second stage, lit-zh being its first: every tower unlocked, from lit-zh's
export (FINETUNE_ZH_START), at a lower lr; the two runs, their cost and what they should reach
are in docs/pipeline.md. `distill-b32-from-b16` trains production's ViT-B/32 with a frozen
ViT-B/16 of open weights as its teacher (train.distill_model, DISTILL_TEACHER_WEIGHTS),
docs/real-data.md too. Only keys that differ from the embedded default are listed; writing a
recipe sets the others any recipe lists back to their defaults (clipforge.pipeline.recipe).
"""

from __future__ import annotations

import copy


def production() -> dict[str, dict]:
    return {
        "data": {
            "source": "laion-parquet",
            # LAION-5B's multilingual metadata, the part with LANGUAGE == zh (see docs/real-data.md)
            "paths": ["datasets/laion-zh/*.parquet"],
            "min_similarity": 0.32,
            "language": "zh",
            "test_dir": "datasets/Flickr30k-CN",
            "val_fraction": 0.001,  # ~tens of thousands of pairs: enough for a stable val loss
            "samples_per_shard": 10000,
            "resize_to": 224,  # ViT-B/32's input: less to decode in every epoch
            # token ids made once here, not in every epoch by the loader workers that also
            # decode the JPEGs (BENCHMARKS.md, loader): the model's tokenizer, no weights
            "pretokenize_model": "ViT-B-32",
            "download_processes": 16,
            "download_threads": 128,
        },
        "model": {"name": "ViT-B-32"},
        "train": {
            "device": "cuda",
            "precision": "bf16",
            "zero_stage": 1,  # the fastest that fits (see above); measured by bench/gpu.py
            "ranks_per_node": 4,
            "global_batch_size": 4096,
            "micro_batch_size": "auto",  # probed on the GPUs: no hand-tuned number to OOM on
            # The reference schedule: 42k steps at batch 4096 (32 epochs of the write-up's
            # ~5.4M pairs). A step count, not epochs: how many pairs a LAION download yields
            # varies (dead links), and the cosine schedule spans max_steps either way.
            "max_steps": 42_000,
            "lr": 5e-4,
            "warmup_steps": 500,
            "num_workers": 8,
            "save_every_steps": 1000,
            "keep_checkpoints": 3,
            "log_every_steps": 50,
            "val_every_steps": 1000,
            "val_retrieval_samples": 5000,
        },
        "eval": {"batch_size": 1024, "suites": production_suites()},
    }


def production_suites() -> list[dict]:
    """The table Chinese CLIP models are published with (Chinese-CLIP's Results.md): retrieval on
    Flickr30K-CN (the data stage copies data.test_dir into data/test, where decontamination
    checks it), COCO-CN and MUGE (text-to-image only: its released split has no image-to-text
    judgements), and zero-shot ImageNet in Chinese-CLIP's layout (label_cn.txt, test/000/...).
    Only Flickr30K-CN is required: the others are scored where their files were put. Keys left
    out take their defaults (clipforge.config.SuiteConfig)."""
    return [
        {"name": "flickr30k-cn", "kind": "retrieval", "path": "data/test"},
        {"name": "coco-cn", "kind": "retrieval", "path": "datasets/COCO-CN", "required": False},
        {
            "name": "muge",
            "kind": "retrieval",
            "path": "datasets/MUGE",
            "directions": "t2i",
            "required": False,
        },
        {
            "name": "imagenet-cn",
            "kind": "zero-shot-classification",
            "path": "datasets/ImageNet-CN/test",
            "classes": "datasets/ImageNet-CN/label_cn.txt",
            "required": False,
        },
    ]


def production_with_model(**model: str) -> dict[str, dict]:
    recipe = copy.deepcopy(production())
    recipe["model"] = dict(model)
    # the stored ids are this model's tokenizer's (the data section names it: model.* are not
    # the data stage's params, so a new model alone does not remake data/)
    recipe["data"]["pretokenize_model"] = model["name"]
    recipe["data"]["pretokenize_text_tower"] = model.get("text_tower")
    return recipe


# The open weights lit-zh starts from: open_clip's `xlm-roberta-base-ViT-B-32` tag
# `laion5b_s13b_b90k` (LAION-5B, every language), as its hub repository has the file:
# `hf download laion/CLIP-ViT-B-32-xlm-roberta-base-laion5B-s13B-b90k open_clip_pytorch_model.bin
# --local-dir datasets/weights/xlm-roberta-base-ViT-B-32-laion5b` (docs/real-data.md).
LIT_ZH_WEIGHTS = "datasets/weights/xlm-roberta-base-ViT-B-32-laion5b/open_clip_pytorch_model.bin"


def lit_zh() -> dict[str, dict]:
    """LiT ("locked-image text tuning", Zhai et al. 2022) in Chinese, as Chinese-CLIP's first
    stage: the image tower of open weights locked, their multilingual text tower tuned on the
    Chinese pairs. A quarter of production's steps at a lower lr (both towers start trained),
    and the start itself evaluated beside the result (eval.baseline_*), so metrics/eval.json
    says what the tuning gained on every suite."""
    name = "xlm-roberta-base-ViT-B-32"
    recipe = production_with_model(name=name, pretrained=LIT_ZH_WEIGHTS)
    recipe["train"].update(lock_image=True, max_steps=10_000, lr=1e-4, warmup_steps=500)
    recipe["eval"].update(baseline_model=name, baseline_pretrained=LIT_ZH_WEIGHTS)
    return recipe


# The teacher distill-b32-from-b16 learns from: open_clip's `ViT-B-16` tag `laion2b_s34b_b88k`
# (LAION-2B, English), as its hub repository has the file: `hf download
# laion/CLIP-ViT-B-16-laion2B-s34B-b88K open_clip_pytorch_model.bin --local-dir
# datasets/weights/ViT-B-16-laion2b` (docs/real-data.md).
DISTILL_TEACHER_WEIGHTS = "datasets/weights/ViT-B-16-laion2b/open_clip_pytorch_model.bin"


def distill_b32_from_b16() -> dict[str, dict]:
    """production's ViT-B/32, from scratch on the Chinese pairs, learning from a frozen ViT-B/16
    of open weights as well (open_clip's DistillClipLoss, both losses weighted 1 as
    open_clip_train does). The two share open_clip's tokenizer and 224 px preprocessing, so the
    teacher takes the student's inputs; the teacher is evaluated beside the student
    (eval.baseline_*), so metrics/eval.json holds the gap per suite."""
    teacher = {"model": "ViT-B-16", "pretrained": DISTILL_TEACHER_WEIGHTS}
    recipe = copy.deepcopy(production())
    recipe["train"].update(distill_model=teacher["model"], distill_pretrained=teacher["pretrained"])
    recipe["eval"].update(
        baseline_model=teacher["model"], baseline_pretrained=teacher["pretrained"]
    )
    return recipe


# Where finetune-zh starts: lit-zh's export (models/clip after a lit-zh run), copied here, out of
# the DVC output the next run replaces (docs/pipeline.md, Parameters and presets).
FINETUNE_ZH_START = "datasets/weights/lit-zh"


def finetune_zh() -> dict[str, dict]:
    """Chinese-CLIP's second stage: after lit-zh (its first, the image tower locked), every
    tower unlocked from lit-zh's export for as many steps, at a lower lr than lit-zh's, as both
    towers start trained and the image tower now moves too. Two runs, each resumable as any
    run: the second's run id holds its start weights' content, so a lit-zh rerun copied to
    FINETUNE_ZH_START starts a new second stage rather than resuming the old one. Scored, as
    lit-zh, against the open weights lit-zh started from: the Δ of both stages together."""
    recipe = lit_zh()
    recipe["model"]["pretrained"] = f"local-dir:{FINETUNE_ZH_START}"
    recipe["train"].update(lock_image=False, lr=3e-5)
    return recipe


def production_large() -> dict[str, dict]:
    recipe = production_with_model(name="ViT-bigG-14")
    recipe["train"].update(zero_stage=3, grad_checkpointing=True)
    return recipe


RECIPES: dict[str, dict[str, dict]] = {
    "default": {},
    "production": production(),
    "production-large": production_large(),
    # Chinese-CLIP's text tower: a Chinese RoBERTa (BERT architecture, character-level vocab).
    "production-zh-roberta": production_with_model(
        name="ViT-B-32", text_tower="hfl/chinese-roberta-wwm-ext"
    ),
    # open_clip's multilingual config: XLM-RoBERTa base text tower (hub id `xlm-roberta-base`).
    "production-xlm-roberta": production_with_model(name="xlm-roberta-base-ViT-B-32"),
    "lit-zh": lit_zh(),
    "distill-b32-from-b16": distill_b32_from_b16(),
    "finetune-zh": finetune_zh(),
}


def summary(recipe: dict[str, dict]) -> str:
    """What tells a recipe apart, read off the recipe itself: model, data, ZeRO stage, GPUs."""
    if not recipe:
        return "the embedded default: tiny, built-in data, CPU, minutes"
    model, data, train = recipe["model"], recipe["data"], recipe["train"]
    tower = f" + {model['text_tower']}" if model.get("text_tower") else ""
    start = ""
    if train.get("lock_image"):
        start = ", image tower locked from model.pretrained"
    elif model.get("pretrained") and not train.get("lock_text"):
        start = ", every tower trained from model.pretrained"
    taught = f", distilled from {train['distill_model']}" if train.get("distill_model") else ""
    return (
        f"{model['name']}{tower}{start}{taught}, {data['source']} {data.get('language', '')}".rstrip()
        + f", ZeRO-{train['zero_stage']}, {train['ranks_per_node']} GPUs"
    )


# Each recipe's gist, read off the recipe: in params.yaml's header and the command's help.
RECIPES_DOC = (
    "; ".join(f"`{name}` ({summary(recipe)})" for name, recipe in RECIPES.items())
    + "; see clipforge/recipes.py"
)
