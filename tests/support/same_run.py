"""A run that changed its data-parallel size mid-way against the uninterrupted run: the same run
bit for bit until the change, then the same maths summed in another order (fp32 round-off)."""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clipforge.export.card import CARD_FILE

# Adam's update from the same state with the gradient summed in another order (ranks
# accumulating micro batches instead of averaging across ranks): fp32 round-off.
WEIGHTS_ATOL = 1e-5
WEIGHTS_RTOL = 1e-4
LOSS_REL = 2e-5  # train.tsv keeps 6 significant digits: one in the last may flip


def curve(root: Path) -> dict[int, tuple[float, float]]:
    """Step -> (loss, gradient norm) from a run's metrics/train.tsv."""
    with open(root / "metrics" / "train.tsv", encoding="utf-8") as rows:
        return {
            int(r["step"]): (float(r["loss"]), float(r["grad_norm"]))
            for r in csv.DictReader(rows, delimiter="\t")
        }


def assert_same_run(reference: Path, got: Path, steps: int, exact_through: int) -> None:
    """Steps 1..exact_through equal bit for bit, the rest within LOSS_REL, and the exported
    weights within WEIGHTS_RTOL/WEIGHTS_ATOL of the reference's."""
    expected, have_curve = curve(reference), curve(got)
    assert sorted(have_curve) == sorted(expected) == list(range(1, steps + 1))
    for step in range(1, exact_through + 1):
        assert have_curve[step] == expected[step], f"step {step}"
    for step in range(exact_through + 1, steps + 1):
        assert have_curve[step] == pytest.approx(expected[step], rel=LOSS_REL), f"step {step}"
    want = load_file(str(reference / "models" / "clip" / "open_clip_model.safetensors"))
    have = load_file(str(got / "models" / "clip" / "open_clip_model.safetensors"))
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(
            have[name], want[name], rtol=WEIGHTS_RTOL, atol=WEIGHTS_ATOL, msg=name
        )


def exported_weights(model_dir: Path) -> dict[str, str]:
    """sha256 of each file of an exported model but those that record the run rather than the
    model: its config (the params, storage.remote among them) and its model cards (the run id,
    where it resumed, its wall time and environment)."""
    return {
        str(p.relative_to(model_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model_dir.rglob("*"))
        if p.is_file() and p.name not in ("clipforge_config.yaml", CARD_FILE)
    }
