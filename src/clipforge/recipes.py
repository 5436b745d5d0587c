"""Named presets of defaults, selected by the top-level `recipe` key of params.yaml.

`default` is the embedded default itself (the field defaults in clipforge.config): a tiny model
on the built-in dataset that trains in minutes on 2 CPU cores. `production` is the reference run:
open_clip ViT-B/32 at 224 px on the LAION-5B Chinese subset, DeepSpeed ZeRO-3 in bf16 on 4 GPUs,
global batch 4096, lr 5e-4 with 500 warm-up steps and cosine decay, evaluated on Flickr30K-CN.
Only keys that differ from the embedded default are listed.
"""

RECIPES: dict[str, dict[str, dict]] = {
    "default": {},
    "production": {
        "data": {
            "source": "local",
            "path": "datasets/laion-zh/pairs.jsonl",
            "test_dir": "datasets/Flickr30k-CN",
            "samples_per_shard": 10000,
        },
        "model": {"name": "ViT-B-32"},
        "train": {
            "device": "cuda",
            "precision": "bf16",
            "zero_stage": 3,
            "ranks_per_node": 4,
            "global_batch_size": 4096,
            "micro_batch_size": 1024,
            "epochs": 5,
            "lr": 5e-4,
            "warmup_steps": 500,
            "num_workers": 8,
            "save_every_steps": 1000,
            "keep_checkpoints": 3,
            "log_every_steps": 50,
        },
        "eval": {"batch_size": 1024},
    },
}
