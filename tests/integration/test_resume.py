"""Exact resume: a run killed with SIGKILL and rerun ends with the weights of an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import subprocess_env, train_argv, write_params
from tests.support.wait import still_running, wait_for

pytestmark = pytest.mark.slow


def _stage_command(root: Path, data: Path) -> list[str]:
    return [sys.executable, "-m", "clipforge.train", *train_argv(root, data, root / "params.yaml")]


def _logged_steps(root: Path) -> list[int]:
    tsv = root / "metrics" / "train.tsv"
    if not tsv.is_file():
        return []
    return [int(line.split("\t")[0]) for line in tsv.read_text().splitlines()[1:]]


def test_sigkill_mid_run_then_rerun_matches_an_uninterrupted_run(
    tmp_path, small_data, reference_run
):
    reference = reference_run
    killed = tmp_path / "killed"
    killed.mkdir()
    write_params(killed / "params.yaml")
    # Step 7 is held until a stop that never comes, so the kill lands after the step-4 checkpoint
    # and after steps 5 and 6 have been taken (and logged), however fast this machine trains:
    # work that the resumed run must redo identically.
    env = {**subprocess_env(), "CLIPFORGE_FAULTS": "hold@7"}
    process = subprocess.Popen(
        _stage_command(killed, small_data),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(
            lambda: 6 in _logged_steps(killed),
            what="the run reaching step 6",
            check=still_running(process, lambda: process.stderr.read().decode()[-2000:]),
            interval=0.5,
        )
    finally:
        process.kill()  # SIGKILL
        process.wait()
    (run_dir,) = (killed / "checkpoints").iterdir()
    assert (run_dir / "latest").read_text().strip() == "step-00000004"
    assert not (killed / "models").exists()

    resumed = subprocess.run(
        _stage_command(killed, small_data),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((killed / "metrics" / "train.json").read_text())
    assert (
        json.loads((killed / "metrics" / "train.info.json").read_text())["resumed_from_step"] == 4
    )

    expected = load_file(str(reference / "models" / "clip" / "open_clip_model.safetensors"))
    got = load_file(str(killed / "models" / "clip" / "open_clip_model.safetensors"))
    assert expected.keys() == got.keys()
    for name in expected:
        assert (expected[name] == got[name]).all(), f"{name} differs from the uninterrupted run"
    reference_summary = json.loads((reference / "metrics" / "train.json").read_text())
    assert summary["loss"] == reference_summary["loss"]
    assert summary["val_loss"] == reference_summary["val_loss"]
    # the metrics table has each step once: rows after the checkpoint were replaced, not doubled
    assert _logged_steps(killed) == [2, 4, 6, 8, 10, 12]
