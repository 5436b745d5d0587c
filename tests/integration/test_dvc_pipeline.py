"""The real DVC pipeline in a temporary git repository: repro, no-op repro, metrics, plots, exps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env, write_params

pytestmark = pytest.mark.slow

TINY = {
    "data": {"num_train": 96, "num_val": 16, "num_test_images": 12},
    "train": {"epochs": 1, "save_every_steps": 2},
}


def _dvc(repo: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = subprocess_env()
    env["PYTHONPATH"] = str(repo / "src")  # the copied code, as in a fresh clone
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    result = subprocess.run(
        ["dvc", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"dvc {' '.join(args)}:\n{result.stdout}\n{result.stderr}"[
        -4000:
    ]
    return result


@pytest.fixture(scope="module")
def pipeline_repo(tmp_path_factory) -> Path:
    """A clone-like git repository with the project's pipeline files and code, after `dvc repro`."""
    repo = tmp_path_factory.mktemp("pipeline")
    for name in ("dvc.yaml", ".dvcignore"):
        shutil.copy(REPO / name, repo / name)
    shutil.copytree(REPO / ".dvc", repo / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"))
    shutil.copytree(REPO / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__"))
    write_params(repo / "params.yaml", TINY)
    (repo / ".gitignore").write_text((REPO / ".gitignore").read_text())
    for command in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"],
    ):
        subprocess.run(command, cwd=repo, check=True)
    _dvc(repo, "repro")
    return repo


def test_repro_runs_data_train_eval_and_writes_the_documented_layout(pipeline_repo):
    for path in (
        "data/manifest.json",
        "data/train",
        "data/val",
        "data/test/test_imgs.tsv",
        "data/test/test_texts.jsonl",
        "models/clip/open_clip_config.json",
        "models/clip/open_clip_model.safetensors",
        "metrics/train.tsv",
        "metrics/train.json",
        "metrics/eval.json",
        "dvc.lock",
    ):
        assert (pipeline_repo / path).exists(), path
    assert any((pipeline_repo / "checkpoints").iterdir())
    assert any((pipeline_repo / "logs").iterdir())
    lock = (pipeline_repo / "dvc.lock").read_text()
    assert all(f"  {stage}:" in lock for stage in ("data", "train", "eval"))


def test_second_repro_runs_nothing(pipeline_repo):
    result = _dvc(pipeline_repo, "repro")
    assert "Running stage" not in result.stdout
    assert "up to date" in result.stdout.lower()


def test_metrics_and_plots_show(pipeline_repo, tmp_path):
    shown = _dvc(pipeline_repo, "metrics", "show", "--json")
    metrics = json.loads(shown.stdout)
    flat = json.dumps(metrics)
    assert "t2i_r01" in flat and "mean_recall" in flat and "val_loss" in flat
    _dvc(pipeline_repo, "plots", "show", "--out", str(tmp_path / "plots"))
    html = (tmp_path / "plots" / "index.html").read_text()
    assert "loss" in html and "learning_rate" in html


def test_exp_run_with_a_changed_param_reruns_train_and_eval_only(pipeline_repo):
    result = _dvc(pipeline_repo, "exp", "run", "-S", "train.lr=5e-4")
    assert "Running stage 'train'" in result.stdout and "Running stage 'eval'" in result.stdout
    assert "Running stage 'data'" not in result.stdout
    shown = json.dumps(json.loads(_dvc(pipeline_repo, "exp", "show", "--json").stdout))
    assert "0.0005" in shown and "t2i_r01" in shown  # the experiment's params and its metrics
