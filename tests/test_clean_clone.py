"""A fresh clone stays shippable: `make demo`, then the commands the README shows, leave only
results in `git status` (dvc.lock, metrics/), which `fab train` does not count as changes; the
table fits 80 columns; the demo's TensorBoard events are in logs/, where the README says."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from clipforge import resolve
from clipforge.launcher.source import current_source, require_clean
from clipforge.pipeline.params import STAGE_PARAMS
from clipforge.repro.experiments import newest_experiment
from tests.conftest import git, subprocess_env, write_params
from tests.support.sshd import free_port
from tests.support.wait import still_running, wait_for

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
    for stage, params in STAGE_PARAMS.items():
        out = origin / "resolved" / f"{stage}.yaml"
        argv = ["--params", str(origin / "params.yaml"), "--out", str(out)]
        assert resolve.main(stage, params, argv) == 0
    git(origin, "commit", "--quiet", "-am", "reduced params")
    git(base, "clone", "--quiet", str(origin), "clone")
    return base / "clone"


def _run(clone: Path, *command: str) -> subprocess.CompletedProcess:
    env = subprocess_env()
    env["PYTHONPATH"] = str(clone / "src")  # the clone's code
    env["COLUMNS"] = "80"  # the terminal the table must fit
    done = subprocess.run(command, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def demo(clone) -> subprocess.CompletedProcess:
    """`make demo` in the clone, with this environment (its stamp not remade)."""
    return _run(clone, "make", "-o", str(VENV / ".clipforge-env"), f"VENV={VENV}", "demo")


def test_demo_shows_the_experiment_with_its_recall_on_screen(demo):
    """The table `make demo` prints: the validation loss, the test set's mean recall and the
    zero-shot top-1 (one suite of each kind), every column whole within an 80-column terminal."""
    lines = demo.stdout.splitlines()
    header = next(x for x in lines if x.strip().startswith("Experiment") and "mean_recall" in x)
    assert header.split()[-3:] == ["val_loss", "test.mean_recall", "colour-shape.top1"]
    assert "…" not in header
    row = next(line for line in lines if "[" in line and "]" in line and "──" in line)
    assert len(row.split()[-3:]) == 3 and "…" not in row
    table = lines[lines.index(header) - 1 : lines.index(row) + 2]
    assert all(len(line) <= 80 for line in table), table


def test_demo_and_the_readme_commands_leave_only_results(clone, demo):
    """After `make demo`, `dvc plots show` and `dvc exp show`: nothing modified, only the
    pipeline's results untracked; `fab train` would ship the clone without --allow-dirty."""
    dvc = str(VENV / "bin" / "dvc")
    _run(clone, dvc, "plots", "show")
    _run(clone, dvc, "exp", "show", "--no-pager")
    changed = git(clone, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert changed and all(line.startswith("?? ") for line in changed), changed
    assert {line[3:] for line in changed} <= {"dvc.lock"} | {
        f"metrics/{name}"
        for name in (
            "train.tsv",
            "val.tsv",
            "train.json",
            "train.info.json",
            "eval.json",
            "eval.info.json",
            "eval.config.yaml",
            "model-card.md",
        )
    }
    require_clean(current_source(clone), allow_dirty=False)


def test_the_demos_tensorboard_events_are_in_logs(clone, demo):
    """`tensorboard --logdir logs` (the README) finds the demo's run."""
    assert list((clone / "logs").glob("*/events.out.tfevents.*"))


def test_the_demo_again_with_nothing_changed_adds_no_experiment(clone, demo):
    """A second `make demo` runs nothing, says so, and `dvc exp show` keeps one row of the
    demo's numbers (DVC's own `dvc exp run` would add a duplicate under a new name)."""
    again = _run(clone, "make", "-o", str(VENV / ".clipforge-env"), f"VENV={VENV}", "demo")
    assert "nothing changed since experiment " in again.stdout, again.stdout[-2000:]
    assert "Running stage" not in again.stdout
    refs = git(clone, "for-each-ref", "--format=%(refname)", "refs/exps").split()
    assert len([ref for ref in refs if newest_experiment(ref)]) == 1, refs


def test_the_readmes_commands_after_the_demo_run_in_its_shell(clone, demo):
    """README.md's block after the demo, as written, in bash in the clone at COLUMNS=80:
    `source .venv/bin/activate` (.venv: the environment make demo used), then `dvc metrics show`
    and `dvc plots show`, each exiting 0 with its output. TensorBoard, a server, is the next
    test's."""
    readme = (clone / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```sh\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    block = next(b for b in blocks if b.startswith("source .venv/bin/activate"))
    lines = [line for line in block.splitlines() if not line.startswith("tensorboard ")]
    assert [line.split()[:3] for line in lines] == [
        ["source", ".venv/bin/activate"],
        ["dvc", "metrics", "show"],
        ["dvc", "plots", "show"],
    ]
    (clone / ".venv").symlink_to(VENV)
    try:
        shown = _run(clone, "bash", "-e", "-c", "\n".join(lines)).stdout
    finally:
        (clone / ".venv").unlink()
    assert "mean_over_suites" in shown and "colour-shape.top1" in shown
    assert (clone / "dvc_plots" / "index.html").is_file()


def test_tensorboard_serves_the_demos_run_from_logs(clone, demo):
    """`tensorboard --logdir logs` (README.md) in the clone serves the demo's run (on a free port,
    not 6006, which another process here may hold)."""
    port = free_port()
    env = subprocess_env()
    server = subprocess.Popen(
        [str(VENV / "bin" / "tensorboard"), "--logdir", "logs", "--port", str(port)],
        cwd=clone,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def runs() -> list[str] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=30) as r:
                return json.loads(r.read()) or None
        except (urllib.error.URLError, ConnectionError):
            return None

    try:
        served = wait_for(
            runs,
            what="tensorboard listing the demo's run",
            interval=0.5,
            check=still_running(server, lambda: ""),
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert served == [path.name for path in (clone / "logs").iterdir()], served
