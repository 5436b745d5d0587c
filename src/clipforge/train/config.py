"""The train stage's params.

The run id (`run_id`) fingerprints what determines a run's result: its data (the manifest), and
its model and train sections but the knobs below, which change how often things are written or
how fast data loads, never the weights. Rerunning the stage with the same params resumes the run.
"""

from __future__ import annotations

import hashlib

from clipforge.config import Config
from clipforge.ids import run_id_for

# Knobs that change how often things are written or how fast data loads, never the weights.
_NOT_IN_FINGERPRINT = {
    "num_workers",
    "save_every_steps",
    "keep_checkpoints",
    "log_every_steps",
    "val_every_steps",
    "val_retrieval_samples",
}


def run_id(config: Config, manifest_bytes: bytes) -> str:
    train = {k: v for k, v in config.to_dict()["train"].items() if k not in _NOT_IN_FINGERPRINT}
    identity = {
        "data": hashlib.sha256(manifest_bytes).hexdigest(),
        "model": config.to_dict()["model"],
        "train": train,
    }
    return run_id_for(identity)
