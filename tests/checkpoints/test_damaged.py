"""A damaged checkpoint is never the end of a run: each kind of damage to the newest one is named
in one line, the checkpoint set aside (not deleted), and the run resumes from the intact one
before it, ending with the weights of an uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from clipforge.checkpoints.checkpointer import Checkpointer
from clipforge.checkpoints.resume import prepare_start
from tests.conftest import run_train

pytestmark = pytest.mark.slow

MODEL = "mp_rank_00_model_states.pt"
OPTIMIZER = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
NEWEST, BEFORE = "step-00000012", "step-00000008"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# damage done to the run directory -> what the line must say about it
DAMAGE = {
    "a truncated model file": (
        lambda run: _truncate(run / NEWEST / MODEL),
        f"{MODEL} is truncated",
    ),
    "a truncated optimizer file": (
        lambda run: _truncate(run / NEWEST / OPTIMIZER),
        f"{OPTIMIZER} is truncated",
    ),
    "an emptied model file": (
        lambda run: (run / NEWEST / MODEL).write_bytes(b""),
        f"{MODEL} is emptied: 0 bytes",
    ),
    "a missing model file": (lambda run: (run / NEWEST / MODEL).unlink(), f"{MODEL} is missing"),
    "a missing step folder": (
        lambda run: shutil.rmtree(run / NEWEST),
        "`latest` names it but it is missing",
    ),
}


def _copy_run(reference_run: Path, into: Path) -> Path:
    """The reference run's checkpoints (steps 8 and 12, `latest` naming 12), to damage."""
    shutil.copytree(reference_run / "checkpoints", into / "checkpoints")
    (run_dir,) = (into / "checkpoints").iterdir()
    return run_dir


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_each_kind_of_damage_falls_back_to_the_checkpoint_before_it(
    damage, reference_run, tmp_path
):
    """One line names the checkpoint and what is wrong with it; it is set aside under a name no
    run reads, `latest` names the intact checkpoint before it, which is chosen."""
    run_dir = _copy_run(reference_run, tmp_path)
    harm, said = DAMAGE[damage]
    harm(run_dir)
    lines: list[str] = []
    assert prepare_start(Checkpointer(run_dir, 2, True), None, lines.append) == BEFORE
    (line,) = lines
    assert f"checkpoint {run_dir / NEWEST} is damaged: {said}" in line
    assert (run_dir / "latest").read_text() == f"{BEFORE}\n"
    kept = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("damaged-"))
    if damage == "a missing step folder":
        assert kept == []  # nothing left to set aside
    else:
        assert len(kept) == 1 and kept[0].startswith(f"damaged-{NEWEST}-") and kept[0] in line
        assert (run_dir / kept[0] / OPTIMIZER).is_file()  # set aside whole, not deleted


def test_a_latest_marker_holding_garbage_falls_back_to_the_newest_intact_checkpoint(
    reference_run, tmp_path
):
    """`latest` that names no checkpoint: set aside, and the newest checkpoint whose files match
    its manifest is chosen (here the one the marker named before it was overwritten)."""
    run_dir = _copy_run(reference_run, tmp_path)
    (run_dir / "latest").write_text("\x00\x17garbage")
    lines: list[str] = []
    assert prepare_start(Checkpointer(run_dir, 2, True), None, lines.append) == NEWEST
    (line,) = lines
    assert f"checkpoint {run_dir / 'latest'} is damaged: it holds '\\x00\\x17garbage'" in line
    (aside,) = run_dir.glob("damaged-latest-*")
    assert aside.read_bytes() == b"\x00\x17garbage"


def test_a_damaged_newest_checkpoint_is_resumed_from_the_one_before_bit_for_bit(
    reference_run, small_data, tmp_path, caplog
):
    """The train stage itself: a truncated optimizer file in the newest checkpoint gives one
    warning (the `checkpoint_damaged` alert) and a resume from step 8 that ends with the weights
    and losses of the uninterrupted run."""
    _copy_run(reference_run, tmp_path)
    (run_dir,) = (tmp_path / "checkpoints").iterdir()
    _truncate(run_dir / NEWEST / OPTIMIZER)
    assert run_train(tmp_path, small_data) == 0
    damaged = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(damaged) == 1 and "WARNING checkpoint_damaged" in damaged[0]
    info = json.loads((tmp_path / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == 8
    expected = load_file(str(reference_run / "models" / "clip" / "open_clip_model.safetensors"))
    got = load_file(str(tmp_path / "models" / "clip" / "open_clip_model.safetensors"))
    assert all((expected[name] == got[name]).all() for name in expected)
    summary = json.loads((tmp_path / "metrics" / "train.json").read_text())
    reference = json.loads((reference_run / "metrics" / "train.json").read_text())
    assert (summary["loss"], summary["val_loss"]) == (reference["loss"], reference["val_loss"])


def test_with_no_intact_checkpoint_the_stage_stops_with_one_line_saying_what_to_do(
    reference_run, small_data, tmp_path, capsys
):
    """Both checkpoints damaged: exit code 2 and one error line naming both and the remedy; both
    are set aside, and the stale `latest` too, so the rerun it suggests trains from step 0."""
    run_dir = _copy_run(reference_run, tmp_path)
    (run_dir / NEWEST / MODEL).write_bytes(b"")
    (run_dir / BEFORE / OPTIMIZER).unlink()
    assert run_train(tmp_path, small_data) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"clipforge.train: error: no intact checkpoint of {run_dir.name}")
    assert f"{NEWEST}: {MODEL} is emptied" in errors[0] and f"{OPTIMIZER} is missing" in errors[0]
    assert "rerun the stage to train from step 0" in errors[0]
    assert sorted(p.name[:21] for p in run_dir.glob("damaged-*")) == [
        "damaged-latest-" + sorted(run_dir.glob("damaged-latest-*"))[0].name[15:21],
        f"damaged-{BEFORE}",
        f"damaged-{NEWEST}",
    ]
    assert not (tmp_path / "models").exists()
    assert run_train(tmp_path, small_data) == 0  # the rerun the line suggests
    info = json.loads((tmp_path / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == 0 and info["steps"] == 12
