"""Exact resume: a run killed with SIGKILL and rerun ends with the weights of an uninterrupted run,
in bf16 (the GPU default: DeepSpeed's bf16 mode), and with SigLIP's loss."""

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
    set_args,
    subprocess_env,
    train_argv,
    write_params,
)
from tests.support.wait import still_running, wait_for

pytestmark = pytest.mark.slow


def _stage_command(root: Path, data: Path, sets: tuple[str, ...]) -> list[str]:
    argv = train_argv(root, data, root / "params.yaml")
    return [sys.executable, "-m", "clipforge.train", *argv, *set_args(sets)]


def _logged_steps(root: Path) -> list[int]:
    tsv = root / "metrics" / "train.tsv"
    if not tsv.is_file():
        return []
    return [int(line.split("\t")[0]) for line in tsv.read_text().splitlines()[1:]]


@dataclass(frozen=True)
class Case:
    """A run to kill and rerun: its uninterrupted twin (a fixture), its params (`--set`), the step
    held (so the kill lands after the checkpoint `resumed_from` and after the step before the
    held one was taken and logged, however fast this machine trains: work that the resumed run
    must redo identically), and the steps its metrics table logs."""

    reference: str
    sets: tuple[str, ...]
    held: int
    resumed_from: int
    logged: list[int]
    distilled: bool = False  # from untrained_model_dir as the teacher (conftest.distill_sets)


# The GPU default. The CPU default (fp32) is killed and resumed to the uninterrupted run's weights
# and curves through `fab`, its supervisor restarting it (tests/launcher/test_supervision.py).
CASES = {
    # the GPU default, bf16: DeepSpeed's bf16 mode at ZeRO-1 (6 steps, a checkpoint every 3)
    "bf16": Case("bf16_run", BF16_SETS, held=5, resumed_from=3, logged=[1, 2, 3, 4, 5, 6]),
    # SigLIP's loss (fp32, accumulation 2): its learned bias resumes with the rest
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
}


# make test kills the GPU default; the other losses' cases are tier2 (each a run and its twin).
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
    if case.distilled:
        sets += distill_sets(request.getfixturevalue("untrained_model_dir"))
    killed = tmp_path / "killed"
    killed.mkdir()
    write_params(killed / "params.yaml")
    env = {**subprocess_env(), "CLIPFORGE_FAULTS": f"hold@{case.held}"}
    process = subprocess.Popen(
        _stage_command(killed, small_data, sets),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(
            lambda: case.held - 1 in _logged_steps(killed),
            what=f"the run reaching step {case.held - 1}",
            check=still_running(process, lambda: process.stderr.read().decode()[-2000:]),
            interval=0.5,
        )
    finally:
        process.kill()  # SIGKILL
        process.wait()
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

    expected = load_file(str(reference / "models" / "clip" / "open_clip_model.safetensors"))
    got = load_file(str(killed / "models" / "clip" / "open_clip_model.safetensors"))
    assert expected.keys() == got.keys()
    for name in expected:
        assert (expected[name] == got[name]).all(), f"{name} differs from the uninterrupted run"
    reference_summary = json.loads((reference / "metrics" / "train.json").read_text())
    assert summary["loss"] == reference_summary["loss"]
    assert summary["val_loss"] == reference_summary["val_loss"]
    # the metrics table has each step once: rows after the checkpoint were replaced, not doubled
    assert _logged_steps(killed) == case.logged
