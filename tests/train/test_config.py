"""A run's id: what names a training run, and what a later clipforge may add without renaming it."""

from __future__ import annotations

from clipforge.pipeline.params import load_pipeline_params
from clipforge.train.config import TrainConfig, run_identity
from tests.conftest import write_params

# Knobs added after runs had started (the tower locks), at their defaults.
LATER_KNOBS = [f.name for f in TrainConfig.knobs() if f.name.startswith("lock_")]


def test_a_knob_added_later_at_its_default_names_an_earlier_run_as_before(tmp_path):
    """The params an earlier clipforge recorded, without the later knobs, name the same run as
    today's with them at their defaults: the earlier run's checkpoints resume after an upgrade."""
    params = load_pipeline_params(write_params(tmp_path / "params.yaml")).to_dict()
    assert LATER_KNOBS and all(name in params["train"] for name in LATER_KNOBS)
    earlier = {
        **params,
        "train": {k: v for k, v in params["train"].items() if k not in LATER_KNOBS},
    }
    assert run_identity(earlier) == run_identity(params)


def test_a_knob_away_from_its_default_is_part_of_the_name(tmp_path):
    base = load_pipeline_params(write_params(tmp_path / "a.yaml")).to_dict()
    seeded = {**base, "train": {**base["train"], "seed": base["train"]["seed"] + 1}}
    renamed = {**base, "model": {**base["model"], "patch_dropout": 0.5}}
    assert run_identity(seeded) != run_identity(base)
    assert run_identity(renamed) != run_identity(base)
    assert run_identity(seeded) != run_identity(renamed)
