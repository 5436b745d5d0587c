"""Exact resume: a run killed with SIGKILL and rerun ends with the weights of an uninterrupted run,
in bf16 (the GPU default: DeepSpeed's bf16 mode); so do a run with SigLIP's loss, a distillation
run, and both stages of finetune-zh: a run with a locked image tower from open weights (LiT: fp32
weights under bf16 autocast), and a run of every tower from its export."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file

from clipforge.checkpoints.layout import tag_for
from tests.conftest import (
    BF16_SETS,
    SIGLIP_SETS,
    distill_sets,
    run_train,
    set_args,
    subprocess_env,
    train_argv,
    write_params,
)
from tests.support.killed_run import WEIGHTS, assert_same_export, sigkill_once_logged
from tests.support.run_curves import tsv_steps

pytestmark = pytest.mark.slow


# LiT (train.lock_image) from open weights (model.pretrained, given by Case.start): the GPU
# default's schedule, in bf16, which with a lock keeps fp32 weights under autocast at ZeRO-1.
LIT_SETS = (*BF16_SETS, "train.lock_image=true")


def _pretrained(start: Path) -> str:
    return f"model.pretrained=local-dir:{start}"


@pytest.fixture(scope="module")
def lit_run(tmp_path_factory, small_data, untrained_model_dir) -> Path:
    """One uninterrupted LiT run (LIT_SETS) from the untrained model's export. Shared: copy it
    first."""
    root = tmp_path_factory.mktemp("lit-run")
    assert run_train(root, small_data, *LIT_SETS, _pretrained(untrained_model_dir)) == 0
    return root


@pytest.fixture(scope="module")
def lit_export(lit_run) -> Path:
    """The LiT run's exported model: where a finetune-zh second stage starts."""
    return lit_run / "models" / "clip"


# finetune-zh's second stage: every tower trained from a LiT run's export, at a lower lr.
FINETUNE_SETS = (*BF16_SETS, "train.lr=3e-4")


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory, small_data, lit_export) -> Path:
    """One uninterrupted second stage (FINETUNE_SETS) from the LiT run's export. Shared: copy it
    first."""
    root = tmp_path_factory.mktemp("finetune-run")
    assert run_train(root, small_data, *FINETUNE_SETS, _pretrained(lit_export)) == 0
    return root


def _stage_command(root: Path, data: Path, sets: tuple[str, ...]) -> list[str]:
    argv = train_argv(root, data, root / "params.yaml")
    return [sys.executable, "-m", "clipforge.train", *argv, *set_args(sets)]


@dataclass(frozen=True)
class Case:
    """A run to kill and rerun: its uninterrupted twin (a fixture), its params (`--set`), the step
    held (so the kill lands after the checkpoint `resumed_from` and after the step before the
    held one was taken and logged, however fast this machine trains: work that the resumed run
    must redo identically), the steps its metrics table logs, and the fixture whose exported
    model it starts from (model.pretrained), if any."""

    reference: str
    sets: tuple[str, ...]
    held: int
    resumed_from: int
    logged: list[int]
    start: str | None = None
    distilled: bool = False  # from untrained_model_dir as the teacher (conftest.distill_sets)


# The GPU default. The CPU default (fp32) is killed and resumed to the uninterrupted run's weights
# and curves through `fab`, its supervisor restarting it (tests/launcher/test_supervision.py).
CASES = {
    # the GPU default, bf16: DeepSpeed's bf16 mode at ZeRO-1 (6 steps, a checkpoint every 3)
    "bf16": Case("bf16_run", BF16_SETS, held=5, resumed_from=3, logged=[1, 2, 3, 4, 5, 6]),
    # SigLIP's loss, bf16: its learned bias and the bias's fp32 master resume with the rest
    "siglip": Case("siglip_run", SIGLIP_SETS, held=5, resumed_from=3, logged=[1, 2, 3, 4, 5, 6]),
    # the same, distilling a smaller student from a bf16 teacher (train.distill_model)
    "distill-bf16": Case(
        "distill_bf16_run",
        BF16_SETS,
        held=5,
        resumed_from=3,
        logged=[1, 2, 3, 4, 5, 6],
        distilled=True,
    ),
    # LiT: the locked tower is no optimizer state, only module weights in the checkpoint
    "lit": Case("lit_run", LIT_SETS, 5, 3, [1, 2, 3, 4, 5, 6], start="untrained_model_dir"),
    # finetune-zh's second stage, from the LiT run's export: every tower in DeepSpeed's bf16 mode
    # again (the first stage's kill is `lit`)
    "finetune": Case("finetune_run", FINETUNE_SETS, 5, 3, [1, 2, 3, 4, 5, 6], start="lit_export"),
}
# make test kills the GPU default; the other cases are tier2, each a run and its twin (make test
# keeps the cheaper proofs: test_siglip.py, test_distillation.py, test_locked_towers.py' reruns).
IN_MAKE_TEST = {"bf16"}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, id=name, marks=() if name in IN_MAKE_TEST else pytest.mark.tier2)
        for name, case in CASES.items()
    ],
)
def test_sigkill_mid_run_then_rerun_matches_an_uninterrupted_run(
    tmp_path, small_data, request, case
):
    reference = request.getfixturevalue(case.reference)
    sets = case.sets
    if case.start:
        sets = (*sets, _pretrained(request.getfixturevalue(case.start)))
    if case.distilled:
        sets += distill_sets(request.getfixturevalue("untrained_model_dir"))
    killed = tmp_path / "killed"
    killed.mkdir()
    write_params(killed / "params.yaml")
    env = {**subprocess_env(), "CLIPFORGE_FAULTS": f"hold@{case.held}"}
    sigkill_once_logged(_stage_command(killed, small_data, sets), killed, case.held - 1, env)
    (run_dir,) = (killed / "checkpoints").iterdir()
    assert (run_dir / "latest").read_text().strip() == tag_for(case.resumed_from)
    assert not (killed / "models").exists()

    resumed = subprocess.run(
        _stage_command(killed, small_data, sets),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((killed / "metrics" / "train.json").read_text())
    info = json.loads((killed / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == case.resumed_from

    assert load_file(str(reference / WEIGHTS)).keys() == load_file(str(killed / WEIGHTS)).keys()
    assert_same_export(reference, killed)
    reference_summary = json.loads((reference / "metrics" / "train.json").read_text())
    assert summary["loss"] == reference_summary["loss"]
    assert summary["val_loss"] == reference_summary["val_loss"]
    # the metrics table has each step once: rows after the checkpoint were replaced, not doubled
    assert tsv_steps(killed) == case.logged
