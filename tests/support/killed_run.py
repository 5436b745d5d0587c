"""A training stage killed with SIGKILL once its metrics log a step, and its export compared bit
for bit with an uninterrupted run's: the exact-resume tests' two halves."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from safetensors.torch import load_file

from tests.conftest import subprocess_env
from tests.support.run_curves import tsv_steps
from tests.support.wait import still_running, wait_for

WEIGHTS = Path("models") / "clip" / "open_clip_model.safetensors"


def sigkill_once_logged(command: list[str], root: Path, step: int, env: dict) -> None:
    """Run `command` (a train stage writing under `root`) and SIGKILL it once its metrics table
    has logged `step`: driven by the run's own rows, never by its speed. Fails with the stage's
    stderr if it ends first."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(
            lambda: step in tsv_steps(root),
            what=f"the run reaching step {step}",
            check=still_running(process, lambda: process.stderr.read().decode()[-2000:]),
            interval=0.5,
        )
    finally:
        process.kill()  # SIGKILL
        process.wait()


def rerun_after_sigkill(command: list[str], root: Path, held: int) -> dict:
    """Run `command` with step `held` held until a stop that never comes, so the SIGKILL lands
    once the step before it is logged; rerun it to its end. The rerun's train.info.json."""
    env = {**subprocess_env(), "CLIPFORGE_FAULTS": f"hold@{held}"}
    sigkill_once_logged(command, root, held - 1, env)
    resumed = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return json.loads((root / "metrics" / "train.info.json").read_text())


def assert_same_export(reference: Path, got: Path) -> None:
    """Every exported tensor of the run under `got` equals the uninterrupted run's."""
    expected = load_file(str(reference / WEIGHTS))
    have = load_file(str(got / WEIGHTS))
    for name in expected:
        assert (expected[name] == have[name]).all(), f"{name} differs from the uninterrupted run"
