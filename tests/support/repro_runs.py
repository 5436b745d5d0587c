"""Run folders made by hand, laid out as the train stage writes them, for the pure tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from clipforge.envrecord import gather
from tests.conftest import REPO, subprocess_env

PARAMS = {"model": {"name": "clipforge-tiny"}, "train": {"lr": 0.001, "seed": 0}}


def make_run(
    path: Path,
    *,
    params: dict | None = None,
    metrics: dict | None = None,
    weights: bytes = b"weights",
    manifest: str = "m" * 64,
) -> Path:
    model = path / "models" / "clip"
    model.mkdir(parents=True)
    (model / "clipforge_config.yaml").write_text(yaml.safe_dump(params or PARAMS))
    (model / "open_clip_model.safetensors").write_bytes(weights)
    environment = gather("train stage").to_dict()
    environment["data_manifest_sha256"] = manifest
    (path / "metrics").mkdir()
    info = {"run_id": "run-0", "environment": environment}
    (path / "metrics" / "train.info.json").write_text(json.dumps(info))
    train = metrics or {"loss": 1.5, "val_loss": 2.0}
    (path / "metrics" / "train.json").write_text(json.dumps(train))
    return path


def fab(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """The real `fab` CLI of this checkout."""
    return subprocess.run(
        [sys.executable, "-m", "fabric", "-r", str(REPO), *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
