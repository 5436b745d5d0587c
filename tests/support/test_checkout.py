"""What the `project` fixture ships (tests/support/checkout.py): the code under test, whatever
pipeline outputs the README's commands left in the checkout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, git
from tests.support.checkout import is_output, pipeline_outputs, shipped_files

TRACKED = ["dvc.yaml", ".gitignore", "params.yaml", "src/clipforge/cli.py", "resolved/train.yaml"]
# What `dvc repro`, `make demo` + `dvc exp apply` and `dvc plots show` leave in a checkout.
OUTPUTS = [
    "dvc.lock",
    "metrics/train.json",
    "metrics/train.tsv",
    "metrics/val.tsv",
    "metrics/train.info.json",
    "metrics/eval.json",
    "metrics/eval.info.json",
    "metrics/eval.config.yaml",
    "metrics/model-card.md",
    "resolved/data.yaml",
    "data/manifest.json",
    "data/train/shard-000000.tar",
    "models/clip/open_clip_config.json",
    "checkpoints/run-0123456789ab/latest",
    "logs/run-0123456789ab/events.out",
    "dvc_plots/index.html",
]
NEW_SOURCES = ["src/clipforge/new_module.py", "tests/data/test_new.py", "docs/new.md"]


@pytest.fixture
def used_checkout(tmp_path) -> Path:
    """A repository with the project's dvc.yaml and .gitignore, a few committed files, the
    outputs of a pipeline run and some new (uncommitted) source files."""
    for name in TRACKED:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / name).is_file():
            shutil.copy(REPO / name, path)
        else:
            path.write_text("x\n")
    git(tmp_path, "init", "--quiet")
    git(tmp_path, "add", "--all")
    git(tmp_path, "commit", "--quiet", "-m", "sources")
    for name in OUTPUTS + NEW_SOURCES:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x\n")
    return tmp_path


def test_pipeline_outputs_stay_out_and_new_sources_go_in(used_checkout):
    """Committed files and new source files are shipped; stage outs, metrics, plots, dvc.lock
    and dvc_plots/ are not (an earlier run's metrics/ would collide with a test's own)."""
    assert shipped_files(used_checkout) == sorted(TRACKED + NEW_SOURCES)


def test_a_committed_file_ships_even_where_the_pipeline_writes_it(used_checkout):
    """resolved/ is a stage out committed on purpose: tracked, so it is code under test."""
    assert is_output("resolved/train.yaml", pipeline_outputs((REPO / "dvc.yaml").read_text()))
    assert "resolved/train.yaml" in shipped_files(used_checkout)


def test_the_outputs_come_from_dvc_yaml_not_a_list():
    """A stage out added to dvc.yaml is excluded without editing the tests."""
    text = (
        "stages:\n  report:\n    cmd: x\n    outs: [reports/]\n    metrics: [{scores.json: {}}]\n"
    )
    patterns = pipeline_outputs(text)
    assert is_output("reports/a/b.html", patterns) and is_output("scores.json", patterns)
    assert not is_output("reports.py", patterns) and not is_output("src/scores.json", patterns)


def test_this_checkout_ships_no_untracked_output():
    """In this very checkout, whatever has run in it: nothing shipped is an untracked output."""
    patterns = pipeline_outputs((REPO / "dvc.yaml").read_text())
    tracked = set(git(REPO, "ls-files").splitlines())
    assert [n for n in shipped_files(REPO) if is_output(n, patterns) and n not in tracked] == []
