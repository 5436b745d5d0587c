"""Two CPU ranks under DeepSpeed's launcher: the run completes, ranks stay in sync, and the
contrastive batch spans both ranks (the result matches the single-rank run of the same batch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import subprocess_env, train_argv, write_params

pytestmark = pytest.mark.slow


def test_two_rank_run_matches_the_single_rank_run(tmp_path, small_data, reference_run):
    params = write_params(tmp_path / "params.yaml")
    # global batch 32 = micro 8 x accumulation 2 x 2 ranks (the reference: 16 x 2 x 1)
    command = [
        sys.executable,
        "-m",
        "clipforge.train",
        *train_argv(tmp_path, small_data, params),
        "--set",
        "train.ranks_per_node=2",
        "--set",
        "train.micro_batch_size=8",
    ]
    result = subprocess.run(
        command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "deepspeed.launcher.runner" in output  # relaunched as 2 processes by DeepSpeed
    assert output.count("replicas in sync across 2 ranks") == 1

    summary = json.loads((tmp_path / "metrics" / "train.json").read_text())
    reference = json.loads((reference_run / "metrics" / "train.json").read_text())
    assert json.loads((tmp_path / "metrics" / "train.info.json").read_text())["steps"] == 12
    assert summary["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    two = load_file(str(tmp_path / "models" / "clip" / "open_clip_model.safetensors"))
    one = load_file(str(reference_run / "models" / "clip" / "open_clip_model.safetensors"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-3, atol=1e-4, msg=name)
