"""Shared fixtures: a reduced params file and a built-in dataset made once per session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from tests.support.checkout import copy_files, shipped_files

REPO = Path(__file__).resolve().parents[1]
# OpenMP threads that wait by spinning (libgomp's default) burn the cores they wait for once more
# threads than cores are busy: a 2-rank run on 2 cores, or the suite's two tiers side by side
# (.ci/run). A small CPU run then took 2.5x its CPU time and 1.8x its wall time. Passive waits
# for every process the tests start, and for the sessions of the tests' sshd (sshd.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A reduced config: the same code paths as the demo, sized for seconds per run.
SMALL_PARAMS = {
    "data": {
        "num_train": 192,
        "num_val": 32,
        "num_test_images": 24,
        "image_size": 32,
        "samples_per_shard": 50,
    },
    "model": {"image_size": 32},
    "train": {
        "global_batch_size": 32,
        "micro_batch_size": 16,
        "epochs": 2,
        "warmup_steps": 2,
        "num_workers": 0,
        "save_every_steps": 4,
        "log_every_steps": 2,
        "device": "cpu",
    },
    "eval": {"batch_size": 64, "device": "cpu"},
}


def write_params(path: Path, overrides: dict | None = None) -> Path:
    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))  # every key
    for section, values in SMALL_PARAMS.items():
        params[section].update(values)
    for section, values in (overrides or {}).items():
        params.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(params, allow_unicode=True), encoding="utf-8")
    return path


@pytest.fixture
def small_params(tmp_path) -> Path:
    return write_params(tmp_path / "params.yaml")


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """data/ of the reduced config, built once by the real data stage."""
    from clipforge.data.stage import main

    root = tmp_path_factory.mktemp("small-data")
    params = write_params(root / "params.yaml")
    assert main(["--params", str(params), "--out", str(root / "data")]) == 0
    return root / "data"


@pytest.fixture
def workdir(tmp_path, small_data, monkeypatch) -> Path:
    """A project-like working directory with params.yaml and a copy of the small data/."""
    write_params(tmp_path / "params.yaml")
    shutil.copytree(small_data, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# Set by an in-process training run in this pytest process (a world of one); a child process
# must not inherit them, or it would try to join that process group.
_PROCESS_GROUP_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _PROCESS_GROUP_VARS}
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["DS_ACCELERATOR"] = "cpu"
    return env


def train_argv(root: Path, data: Path, params: Path, checkpoints: Path | None = None) -> list[str]:
    """The train stage's arguments, writing everything under `root` (the checkpoints under
    root/checkpoints unless given)."""
    return [
        "--params",
        str(params),
        "--data",
        str(data),
        "--checkpoints",
        str(checkpoints or root / "checkpoints"),
        "--model-out",
        str(root / "models" / "clip"),
        "--logs",
        str(root / "logs"),
        "--metrics",
        str(root / "metrics"),
    ]


def eval_argv(params: Path, model: str, test_data: Path, out: Path) -> list[str]:
    """The eval stage's arguments."""
    return ["--params", str(params), "--model", model, "--data", str(test_data), "--out", str(out)]


def run_train(root: Path, data: Path, *overrides: str, checkpoints: Path | None = None) -> int:
    """The train stage in-process with the reduced params (see train_argv)."""
    from clipforge.train.stage import main

    params = write_params(root / "params.yaml")
    return main([*train_argv(root, data, params, checkpoints), *set_args(overrides)])


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, small_data) -> Path:
    """One uninterrupted single-rank run of the reduced config (12 steps, checkpoints every 4).
    Shared: tests must not write into it (copy it first)."""
    root = tmp_path_factory.mktemp("reference-run")
    assert run_train(root, small_data) == 0
    return root


# Two ranks of the reduced config: global batch 32 = micro 16 x accumulation 1 x 2 ranks (on one
# rank, 16 x 2 x 1), the loss of every step logged.
TWO_RANK_SETS = ("train.ranks_per_node=2", "train.log_every_steps=1")


def train_command(root: Path, data: Path, sets: Sequence[str]) -> list[str]:
    """The train stage as a process of its own (DeepSpeed's launcher relaunches it for several
    ranks), with the reduced params written to root/params.yaml and `sets` over them."""
    params = write_params(root / "params.yaml")
    return [
        sys.executable,
        "-m",
        "clipforge.train",
        *train_argv(root, data, params),
        *set_args(sets),
    ]


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory, small_data) -> Path:
    """One uninterrupted 2-rank run of the reduced config (TWO_RANK_SETS), its output in
    root/stage.log. Shared: tests must not write into it."""
    root = tmp_path_factory.mktemp("two-rank-run")
    done = subprocess.run(
        train_command(root, small_data, TWO_RANK_SETS),
        cwd=root,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    (root / "stage.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return root


# The production numeric path, on the CPU: `train.precision: bf16`, which a GPU run's `auto` is.
# At ZeRO-1 that is DeepSpeed's own bf16 mode (bf16 weights, fp32 master weights and gradient
# accumulation); at ZeRO-2/3, fp32 weights under bf16 autocast. bf16 trains about 3 times slower
# than fp32 on this CPU: 6 steps, a checkpoint every 3, the loss of every step logged.
BF16_SETS = (
    "train.precision=bf16",
    "train.max_steps=6",
    "train.save_every_steps=3",
    "train.log_every_steps=1",
)


def set_args(sets: Sequence[str]) -> list[str]:
    """`--set` before each of `sets`: a stage's command-line overrides."""
    return [arg for item in sets for arg in ("--set", item)]


@pytest.fixture(scope="session")
def bf16_run(tmp_path_factory, small_data) -> Path:
    """One uninterrupted single-rank bf16 ZeRO-1 run of the reduced config (BF16_SETS). Shared:
    tests must not write into it (copy it first)."""
    root = tmp_path_factory.mktemp("bf16-run")
    assert run_train(root, small_data, *BF16_SETS) == 0
    return root


# SigLIP's loss on the reduced config, on the GPU default's numeric path (BF16_SETS): its learned
# bias is a bf16 weight with an fp32 master in DeepSpeed's bf16 mode, and exported as fp32.
SIGLIP_SETS = (*BF16_SETS, "train.loss=siglip")


@pytest.fixture(scope="session")
def siglip_run(tmp_path_factory, small_data) -> Path:
    """One uninterrupted single-rank run with SigLIP's loss (SIGLIP_SETS). Shared: tests must not
    write into it (copy it first)."""
    root = tmp_path_factory.mktemp("siglip-run")
    assert run_train(root, small_data, *SIGLIP_SETS) == 0
    return root


def distill_sets(teacher: Path) -> tuple[str, ...]:
    """A smaller student (clipforge-micro) distilled from `teacher`, an exported clipforge-tiny."""
    return ("model.name=clipforge-micro", f"train.distill_model=local-dir:{teacher}")


@pytest.fixture(scope="session")
def distill_bf16_run(tmp_path_factory, small_data, untrained_model_dir) -> Path:
    """One uninterrupted single-rank bf16 ZeRO-1 distillation run (BF16_SETS, distill_sets from
    untrained_model_dir: its teacher in bf16 too). Shared: tests must not write into it."""
    root = tmp_path_factory.mktemp("distill-bf16-run")
    assert run_train(root, small_data, *BF16_SETS, *distill_sets(untrained_model_dir)) == 0
    return root


@pytest.fixture(scope="session")
def untrained_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised clipforge-tiny (32 px) exported in open_clip's local-dir layout, as
    the train stage exports: a real model folder without a training run. Shared: copy it first."""
    from clipforge.export.local_dir import export_model
    from clipforge.model.config import ModelConfig
    from clipforge.model.factory import build_model

    bundle = build_model(ModelConfig(image_size=32))
    out = tmp_path_factory.mktemp("untrained") / "clip"
    export_model(bundle.model.state_dict(), bundle.model_cfg, bundle.preprocess_cfg, "", out)
    return out


@pytest.fixture(scope="session")
def project(tmp_path_factory) -> Path:
    """The project as it is in this checkout (tracked and new source files, not the outputs of a
    pipeline run in it: tests/support/checkout.py), committed in a repository of its own: what
    `fab train` ships is exactly the code under test."""
    root = tmp_path_factory.mktemp("project")
    copy_files(REPO, shipped_files(REPO), root)
    git(root, "init", "--quiet")
    git(root, "add", "--all")
    git(root, "commit", "--quiet", "-m", "snapshot under test")
    return root


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=test", "-c", "user.email=test@example.org", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (tests/support/s3store.py), shared: each test makes its own bucket."""
    from tests.support.s3store import S3Server

    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The S3 server, with this process's environment set to reach it (as a user's would be)."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server
