"""DVC experiments named for what they are (clipforge.repro.experiments), with real DVC and git
on a one-stage pipeline: a fetched run's experiment takes its launch id and smoke mark, and the
demo run again with nothing changed adds no experiment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clipforge.repro import runs
from clipforge.repro.experiments import (
    ExperimentError,
    experiment_name,
    experiments_here,
    fetch_experiment_bundle,
    launch_of,
    newest_experiment,
    renamed,
    run_unless_unchanged,
    unchanged_experiment,
)
from tests.conftest import git, subprocess_env

LAUNCH_ID = "20261201-101112-abcdef01"
# The stage writes eval.json as the eval stage does: a suite's headline, then the mean.
STAGE = """\
stages:
  eval:
    cmd: >-
      python -c "import json, yaml; lr = yaml.safe_load(open('params.yaml'))['lr'];
      json.dump({'test': {'mean_recall': lr * 100}, 'mean_over_suites': lr * 100},
      open('metrics/eval.json', 'w'))"
    params: [lr]
    metrics: [metrics/eval.json: {cache: false}]
"""


def dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=repo,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"dvc {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def experiment_refs(repo: Path) -> list[str]:
    refs = git(repo, "for-each-ref", "--format=%(refname)", "refs/exps").split()
    return [ref for ref in refs if newest_experiment(ref)]


@pytest.fixture
def pipeline(tmp_path, monkeypatch) -> Path:
    """A git repository with a one-stage DVC pipeline, committed."""
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    repo = tmp_path / "home"
    repo.mkdir()
    git(repo, "init", "--quiet")
    for key, value in (("user.name", "test"), ("user.email", "test@example.org")):
        git(repo, "config", key, value)
    dvc(repo, "init", "--quiet")
    (repo / "dvc.yaml").write_text(STAGE)
    (repo / "params.yaml").write_text("lr: 0.25\n")
    (repo / "metrics").mkdir()
    (repo / "metrics" / ".gitkeep").write_text("")
    git(repo, "add", "--all")
    git(repo, "commit", "--quiet", "-m", "pipeline")
    return repo


def test_a_fetched_runs_experiment_is_named_by_its_launch_id_and_smoke_mark(pipeline, tmp_path):
    """The run's experiment, made on a host by `dvc exp run` (a random name), bundled there as
    `fab fetch` bundles it and fetched here: `dvc exp show` lists it as `<launch id>-smoke`,
    `fab runs` reads that as the launch id marked smoke, and fetched again it replaces itself."""
    host = tmp_path / "host"
    git(tmp_path, "clone", "--quiet", str(pipeline), str(host))
    dvc(host, "exp", "run", "-S", "lr=0.5")
    (ref,) = experiment_refs(host)
    commit = git(pipeline, "rev-parse", "HEAD").strip()
    bundle = tmp_path / "experiment.bundle"
    git(host, "bundle", "create", str(bundle), ref, f"^{commit}")
    name = experiment_name(LAUNCH_ID, smoke=True)

    for _ in range(2):  # fetched twice: one experiment
        fetch_experiment_bundle(pipeline, bundle, ref, name)
        assert experiment_refs(pipeline) == [renamed(ref, name)]

    shown, failed = experiments_here(pipeline)
    assert failed is None
    names = [group["name"] for entry in shown for group in entry.get("experiments") or []]
    assert names == [f"{LAUNCH_ID}-smoke"]
    (run,) = [r for r in runs.from_experiments(shown) if r.experiment == name]
    assert (run.label, run.metrics["mean_over_suites"]) == (f"{LAUNCH_ID} smoke", 50.0)


def test_an_experiment_git_refuses_is_one_line_naming_git(pipeline, tmp_path):
    ref = f"refs/exps/ab/{'cd' * 19}/brief-vega"
    with pytest.raises(ExperimentError, match="^git fetch of the run's experiment failed: "):
        fetch_experiment_bundle(pipeline, tmp_path / "missing.bundle", ref, LAUNCH_ID)


def test_names_that_are_launch_ids_are_read_back_and_others_are_not():
    assert launch_of(experiment_name(LAUNCH_ID, smoke=False)) == (LAUNCH_ID, False)
    assert launch_of(experiment_name(LAUNCH_ID, smoke=True)) == (LAUNCH_ID, True)
    for other in ("malar-eggs", f"{LAUNCH_ID}-smoke-2", "smoke", f"x{LAUNCH_ID}"):
        assert launch_of(other) is None, other
    with pytest.raises(ValueError):
        renamed(f"refs/exps/ab/{'cd' * 19}/brief-vega", "../heads/main")


def test_the_demo_run_again_unchanged_adds_no_experiment(pipeline):
    """What `make demo` runs: a second time with nothing changed, no `dvc exp run` and no second
    experiment with the same numbers; after a param changes, a new experiment; that param back,
    the workspace is the first experiment's again."""
    said: list[str] = []
    assert unchanged_experiment(pipeline) is None  # nothing has run
    assert run_unless_unchanged(pipeline, said.append) == 0
    (first,) = experiment_refs(pipeline)
    assert run_unless_unchanged(pipeline, said.append) == 0
    assert experiment_refs(pipeline) == [first]
    name = first.rsplit("/", 1)[-1]
    assert said == [
        f"nothing changed since experiment {name} (params, code, data): not run again; "
        "`dvc exp run -f` runs it anyway"
    ]

    (pipeline / "params.yaml").write_text("lr: 0.75\n")
    assert unchanged_experiment(pipeline) is None  # DVC has a stage to run
    assert run_unless_unchanged(pipeline, said.append) == 0
    assert len(experiment_refs(pipeline)) == 2
    assert json.loads((pipeline / "metrics" / "eval.json").read_text())["mean_over_suites"] == 75

    dvc(pipeline, "exp", "apply", name)
    assert unchanged_experiment(pipeline) == name
