"""A fresh clone stays clean: `make demo`, then the commands the README shows, leave `git status`
empty, and `fab train` ships the clone as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clipforge.launcher.source import current_source, require_clean
from clipforge.resolve import main as resolve_main
from tests.conftest import git, subprocess_env, write_params

pytestmark = pytest.mark.slow

VENV = Path(sys.executable).parent.parent
# The demo's code paths on the reduced config (tests/conftest.py): seconds, not minutes.
SMALL = {"train": {"epochs": 1}}


@pytest.fixture(scope="module")
def clone(project, tmp_path_factory) -> Path:
    """A clone of the project as committed here, its params reduced (with the resolved params
    they give) in a commit of their own: what a user gets from `git clone`."""
    base = tmp_path_factory.mktemp("clean-clone")
    origin = base / "origin"
    git(base, "clone", "--quiet", str(project), str(origin))
    write_params(origin / "params.yaml", SMALL)
    for stage in ("data", "train", "eval"):
        out = origin / "resolved" / f"{stage}.yaml"
        assert (
            resolve_main([stage, "--params", str(origin / "params.yaml"), "--out", str(out)]) == 0
        )
    git(origin, "commit", "--quiet", "-am", "reduced params")
    git(base, "clone", "--quiet", str(origin), "clone")
    return base / "clone"


def _run(clone: Path, *command: str) -> subprocess.CompletedProcess:
    env = subprocess_env()
    env["PYTHONPATH"] = str(clone / "src")  # the clone's code
    env["COLUMNS"] = "120"  # the terminal the table must fit
    done = subprocess.run(command, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def demo(clone) -> subprocess.CompletedProcess:
    """`make demo` in the clone, with this environment (its stamp not remade)."""
    return _run(clone, "make", "-o", str(VENV / ".clipforge-env"), f"VENV={VENV}", "demo")


def test_demo_shows_the_experiment_with_its_recall_on_screen(demo):
    """The table `make demo` prints: the experiment's recall (R@1, R@5, R@10 both ways, in that
    order) and mean recall, every column whole within a 120-column terminal."""
    lines = demo.stdout.splitlines()
    header = next(line for line in lines if line.strip().startswith("Experiment"))
    recall = ["t2i_r01", "t2i_r05", "t2i_r10", "i2t_r01", "i2t_r05", "i2t_r10", "mean_recall"]
    assert header.split()[-7:] == recall and "…" not in header
    row = next(line for line in lines if "[" in line and "]" in line and "──" in line)
    assert len(row.split()[-7:]) == 7 and "…" not in row
    assert all(len(line) <= 120 for line in lines[lines.index(header) - 1 :])


def test_demo_and_the_readme_commands_leave_the_clone_clean(clone, demo):
    """After `make demo`, `dvc plots show` and `dvc exp show`: nothing modified, nothing
    untracked; `fab train` would ship the clone without asking for --allow-dirty."""
    dvc = str(VENV / "bin" / "dvc")
    _run(clone, dvc, "plots", "show")
    _run(clone, dvc, "exp", "show", "--no-pager")
    assert git(clone, "status", "--porcelain", "--untracked-files=all") == ""
    require_clean(current_source(clone), allow_dirty=False)
