"""Chinese-CLIP's two stages (the lit-zh and finetune-zh recipes): a run with the image tower
locked, then a second run of every tower from the first's export, at a lower lr. Each is a run
of its own, resumable as any run (kill -9 in either: tests/train/test_resume.py's `lit` and
`finetune` cases); the second's run id holds its start weights' content.

The recipes themselves are production-sized; here the same knobs run on the tiny model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clipforge.eval.stage import main as eval_main
from clipforge.pipeline.recipe import recipe_params
from clipforge.recipes import FINETUNE_ZH_START
from tests.conftest import run_train, write_params

WEIGHTS = "open_clip_model.safetensors"


def test_finetune_zh_starts_every_tower_from_lit_zh_at_a_lower_lr():
    """finetune-zh is lit-zh's run continued: its model and data, the image tower unlocked,
    model.pretrained the place lit-zh's export is copied to, a lower lr, and scored against the
    open weights lit-zh started from (the Δ of both stages)."""
    first, second = recipe_params("lit-zh"), recipe_params("finetune-zh")
    assert first.train.lock_image and not second.train.locks_a_tower
    assert second.model.pretrained == f"local-dir:{FINETUNE_ZH_START}"
    assert second.model.name == first.model.name and second.data == first.data
    assert second.train.lr < first.train.lr
    assert second.eval.baseline_pretrained == first.model.pretrained


def _start(tmp_path: Path, export: Path) -> str:
    """`export` copied where a second stage starts from, as the documented flow copies
    models/clip: one path, whichever first stage was copied there last."""
    start = tmp_path / "weights" / "lit"
    shutil.rmtree(start, ignore_errors=True)
    shutil.copytree(export, start)
    return f"model.pretrained=local-dir:{start}"


def _changed(before: dict, after: dict, prefix: str) -> list[str]:
    return [n for n in before if n.startswith(prefix) and not torch.equal(before[n], after[n])]


@pytest.mark.slow
def test_the_second_stage_moves_the_image_tower_the_first_kept(
    untrained_model_dir, small_data, tmp_path, workdir
):
    """Stage 1 (train.lock_image) leaves every `visual.*` tensor as the start gave it while the
    text tower moves; stage 2, from stage 1's export with nothing locked, moves the image tower
    too, and eval scores it against the weights stage 1 started from (the recipes' Δ). A stage 2
    rerun from a different stage 1 at the same path is a new run, not a resume of the old
    one."""
    start = load_file(str(untrained_model_dir / WEIGHTS))
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    stage1.mkdir()
    stage2.mkdir()
    sets = ("train.lock_image=true", "train.max_steps=3")
    assert (
        run_train(stage1, small_data, f"model.pretrained=local-dir:{untrained_model_dir}", *sets)
        == 0
    )
    locked = load_file(str(stage1 / "models" / "clip" / WEIGHTS))
    assert _changed(start, locked, "visual.") == []
    assert _changed(start, locked, "transformer.")

    second = ("train.lr=3e-4", "train.max_steps=3")
    assert run_train(stage2, small_data, _start(tmp_path, stage1 / "models" / "clip"), *second) == 0
    tuned = load_file(str(stage2 / "models" / "clip" / WEIGHTS))
    image = [n for n in locked if n.startswith("visual.")]
    assert sorted(_changed(locked, tuned, "visual.")) == sorted(image)
    assert _changed(locked, tuned, "transformer.")

    # the Δ of both stages: the second's export scored with the first's start as the baseline
    write_params(
        workdir / "params.yaml", {"eval": {"baseline_model": f"local-dir:{untrained_model_dir}"}}
    )
    assert (
        eval_main(["--params", "params.yaml", "--model", f"local-dir:{stage2 / 'models' / 'clip'}"])
        == 0
    )
    metrics = json.loads((workdir / "metrics" / "eval.json").read_text())
    assert metrics["delta"]["mean_over_suites"] == pytest.approx(
        metrics["mean_over_suites"] - metrics["baseline"]["mean_over_suites"]
    )

    # another first stage copied to the same path (here: the untrained start itself)
    assert run_train(stage2, small_data, _start(tmp_path, untrained_model_dir), *second) == 0
    info = json.loads((stage2 / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == 0
    assert len(list((stage2 / "checkpoints").iterdir())) == 2
    assert not torch.equal(
        load_file(str(stage2 / "models" / "clip" / WEIGHTS))["visual.proj"], tuned["visual.proj"]
    )
