"""Disk faults at checkpoint time, on real file systems (a tmpfs per test): the run stops with
"no permission to write X" or "disk full at X: N bytes free, a checkpoint needs ~M" instead of
torch's zip-writer errors, warns before the disk is full, and `latest` stays a checkpoint the
rerun resumes exactly from."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from clipforge.checkpoints.disk import tree_bytes
from tests.conftest import run_train, subprocess_env, train_argv, write_params
from tests.support.mounts import remount, tmpfs
from tests.support.wait import still_running, wait_for

pytestmark = pytest.mark.slow

# The reduced config's checkpoint: 5,460,289 parameters x 16 bytes, plus a little (measured).
CHECKPOINT_BYTES = 87_406_126


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("clipforge.train: error:")]


def _latest(checkpoints: Path) -> str | None:
    markers = list(checkpoints.glob("run-*/latest"))
    return markers[0].read_text().strip() if markers else None


# A real run (~25 s): in make test-tier2. make test keeps the filling-disk run below and the
# checkpointer's own refusals (test_never_lost.py).
@pytest.mark.tier2
def test_checkpoints_made_read_only_mid_run_stop_it_with_a_clear_line(tmp_path, small_data):
    """Step 6 is held until the stop arrives, so the folder turns read-only after the step-4
    checkpoint and before the stop's own save, however fast the machine trains."""
    write_params(tmp_path / "params.yaml")
    with tmpfs(tmp_path / "disk", 4 * CHECKPOINT_BYTES) as disk:
        checkpoints = disk / "checkpoints"
        stage = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clipforge.train",
                *train_argv(tmp_path, small_data, tmp_path / "params.yaml", checkpoints),
            ],
            env={**subprocess_env(), "CLIPFORGE_FAULTS": "hold@6"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(
                lambda: _latest(checkpoints) == "step-00000004",
                what="the run saving step 4",
                check=still_running(stage, lambda: stage.stderr.read()[-2000:]),
                interval=0.2,
            )
            remount(disk, "ro")
            stage.send_signal(signal.SIGTERM)
            code = stage.wait(timeout=300)
        finally:
            if stage.poll() is None:
                stage.kill()
                stage.wait()
        stderr = stage.stderr.read()
        (run_dir,) = checkpoints.glob("run-*")
        assert code == 2, stderr[-2000:]
        assert _error_lines(stderr) == [
            f"clipforge.train: error: no permission to write {run_dir}; make it writable or "
            f"choose another folder"
        ]
        assert (run_dir / "latest").read_text() == "step-00000004\n"
        assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["step-00000004"]
        assert not (tmp_path / "models").exists()


def test_a_filling_disk_warns_first_then_stops_before_writing_and_the_rerun_resumes_exactly(
    tmp_path, small_data, reference_run, caplog, capsys
):
    """Room for two and a half checkpoints: the step-4 save fits, the step-8 save fits but leaves
    too little for another (a disk_space_low alert), the step-12 save is refused before a byte is
    written. With room again, the rerun resumes from step 8 and ends with the weights of an
    uninterrupted run."""
    with tmpfs(tmp_path / "disk", CHECKPOINT_BYTES * 5 // 2) as disk:
        checkpoints = disk / "checkpoints"
        assert run_train(tmp_path, small_data, checkpoints=checkpoints) == 2
        (run_dir,) = checkpoints.glob("run-*")
        (error,) = _error_lines(capsys.readouterr().err)
        need = tree_bytes(run_dir / "step-00000008")
        match = re.fullmatch(
            rf"clipforge\.train: error: disk full at {re.escape(str(run_dir))}: ([\d,]+) bytes "
            rf"free, a checkpoint needs ~{need:,} bytes; free space there \(or give "
            rf"--checkpoints another disk\) and rerun the stage to resume from the last checkpoint",
            error,
        )
        assert match and int(match.group(1).replace(",", "")) < need
        alerts = [r.getMessage() for r in caplog.records if "disk_space_low" in r.getMessage()]
        assert len(alerts) == 1 and " step 8 " in alerts[0]
        assert (run_dir / "latest").read_text() == "step-00000008\n"
        assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == [
            "step-00000004",
            "step-00000008",
        ]
        assert not (tmp_path / "models").exists()

        remount(disk, f"size={4 * CHECKPOINT_BYTES}")
        assert run_train(tmp_path, small_data, checkpoints=checkpoints) == 0
    info = json.loads((tmp_path / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == 8
    expected = load_file(str(reference_run / "models" / "clip" / "open_clip_model.safetensors"))
    got = load_file(str(tmp_path / "models" / "clip" / "open_clip_model.safetensors"))
    assert all((expected[name] == got[name]).all() for name in expected)
