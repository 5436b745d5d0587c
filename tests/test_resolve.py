"""What each stage runs with, its sections of params.yaml: printed by --print-config, and committed
in resolved/<stage>.yaml for DVC (the `params-<stage>` stages write it)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from clipforge import resolve
from clipforge.data.stage import main as data_main
from clipforge.eval.stage import main as eval_main
from clipforge.pipeline.params import STAGE_PARAMS
from clipforge.pipeline.recipe import main as recipe_main
from clipforge.train.stage import main as train_main
from tests.conftest import REPO

STAGE_MAINS = {"data": data_main, "train": train_main, "eval": eval_main}


def resolve_main(stage: str, argv: list[str]) -> int:
    """`python -m clipforge.<stage>.config ARGV`, in-process."""
    return resolve.main(stage, STAGE_PARAMS[stage], argv)


@pytest.mark.parametrize("stage", sorted(STAGE_PARAMS))
def test_committed_resolved_params_are_what_the_params_stage_writes(stage, tmp_path):
    """resolved/<stage>.yaml in the repository is exactly what `dvc repro` rewrites from the
    committed params.yaml: a fresh clone's pipeline leaves it unchanged, byte for byte."""
    out = tmp_path / f"{stage}.yaml"
    assert resolve_main(stage, ["--params", str(REPO / "params.yaml"), "--out", str(out)]) == 0
    assert out.read_bytes() == (REPO / "resolved" / f"{stage}.yaml").read_bytes()


@pytest.mark.parametrize("stage", sorted(STAGE_PARAMS))
def test_print_config_shows_what_the_file_says_and_runs_nothing(stage, tmp_path, capsys):
    """With the production recipe written into params.yaml, `--print-config` prints the
    sections the stage reads with the recipe's values, the same as its resolved file; nothing
    else happens (no data/ is needed)."""
    params = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", params)
    assert recipe_main(["production", "--params", str(params)]) == 0
    capsys.readouterr()
    assert STAGE_MAINS[stage](["--params", str(params), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert set(printed) == set(STAGE_PARAMS[stage].sections())
    out = tmp_path / "resolved.yaml"
    assert resolve_main(stage, ["--params", str(params), "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == printed
    if stage == "train":
        train = printed["train"]
        assert (train["lr"], train["global_batch_size"], train["precision"]) == (5e-4, 4096, "bf16")


def test_print_config_checks_the_params(capsys):
    """A bad value is the usual one-line error, exit 2, with --print-config too."""
    argv = ["--params", str(REPO / "params.yaml"), "--set", "train.lr=-1", "--print-config"]
    assert train_main(argv) == 2
    assert "train.lr" in capsys.readouterr().err


def test_resolve_reports_a_bad_param_in_one_line(tmp_path, capsys):
    """The params stage stops on a bad value of its own stage's sections, writing nothing."""
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  zero_stage: 4\n")
    out = tmp_path / "train.yaml"
    assert resolve_main("train", ["--params", str(params), "--out", str(out)]) == 2
    assert "train.zero_stage" in capsys.readouterr().err and not out.exists()
    assert resolve_main("data", ["--params", str(params), "--out", str(tmp_path / "d.yaml")]) == 0
