"""The GPU benchmark cannot rot: its whole path runs on CPU with a tiny model (--dry-run),
through the same wrapper an offline GPU machine runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, subprocess_env

pytestmark = pytest.mark.slow


def _run_wrapper(out, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "bench" / "gpu-run.sh"), str(out), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


# ~40 s of CPU: in make test-tier2 (.ci/run), which keeps it from rotting all the same
@pytest.mark.tier2
def test_dry_run_measures_every_section_and_writes_json_and_markdown(tmp_path):
    result = _run_wrapper(
        tmp_path / "out", {**subprocess_env(), "PYTHON": sys.executable}, "--dry-run"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "gpu-bench.json").read_text())
    assert data["dry_run"] is True
    assert all(rate > 0 for rate in data["loader"]["images_per_s"].values())
    steps = data["step"]
    assert sorted((r["zero"], r["micro"], r["grad_checkpointing"]) for r in steps) == sorted(
        [(z, m, False) for z in (1, 2, 3) for m in (8, 16)] + [(1, 16, True)]
    )
    for row in steps:
        assert "error" not in row, row
        assert row["samples_per_s"] > 0 and row["mfu_measured_peak"] > 0 and row["peak_mem_gb"] > 0
    assert data["end_to_end"]["samples_per_s"] > 0 and data["end_to_end"]["loader_over_step"] > 0
    run = data["train_run"]
    assert run["stopped_exit_code"] == 143  # stopped by SIGTERM with a checkpoint...
    assert run["resumed_from_step"] == data["profile"]["run_hold_step"]  # ...resumed from it
    assert run["steps"] == data["profile"]["run_steps"]
    assert run["loss_falls"] is True and run["export_loads_in_open_clip"] is True
    table = (tmp_path / "out" / "gpu-bench.md").read_text()
    for heading in ("(a) loader alone", "(b) train step", "(c) end to end", "(d) python -m"):
        assert heading in table


def test_a_machine_without_deepspeed_and_without_wheels_gets_the_remedy(tmp_path):
    """A bare Python (a venv with nothing installed) and an empty wheel folder: exit 2, naming
    `make bench-wheels`, before anything runs."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True
    )
    (tmp_path / "wheels").mkdir()
    env = {
        **subprocess_env(),
        "PYTHON": str(tmp_path / "bare" / "bin" / "python"),
        "CLIPFORGE_WHEELS": str(tmp_path / "wheels"),
    }
    result = _run_wrapper(tmp_path / "out", env, "--dry-run")
    assert result.returncode == 2
    assert "make bench-wheels" in result.stderr
    assert not (tmp_path / "out").exists()
