"""The README's journey, walked as documented, in one clone, against this machine's sshd:
`make demo` (its `dvc exp run`, on a small committed config) -> `dvc exp apply` -> `dvc repro`
(nothing to do) -> `fab check` -> `fab train --smoke` -> `fab status` until finished -> `fab fetch`
-> `dvc exp show`. No step may be refused because of what an earlier one left: the demo's results
and the host's Python setting (FABRIC_CLIPFORGE_PYTHON, as make_fab sets it) stay out of the way.
The fetched eval.json is the eval stage's own numbers for the fetched model on the run's test set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import git, subprocess_env, write_params
from tests.launcher.conftest import LaunchedRun, make_fab

# The whole journey (demo, experiment, launch, eval, fetch: about a minute): in make test-tier2
# (.ci/run). make test keeps its parts: the demo in a clean clone (test_clean_clone.py), the
# pipeline in a temp repo (test_dvc_pipeline.py), a run launched, watched and fetched through
# `fab` (test_smoke_run.py), the hints (test_hints.py).
pytestmark = [pytest.mark.slow, pytest.mark.tier2]

RECALL_KEYS = {"t2i_r01", "t2i_r05", "t2i_r10", "i2t_r01", "i2t_r05", "i2t_r10", "mean_recall"}


def _tool(clone: Path, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """A tool of .venv (dvc, python) in the clone, as in the activated shell the README asks for."""
    env = subprocess_env()
    env["PYTHONPATH"] = str(clone / "src")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    done = subprocess.run(
        list(argv), cwd=clone, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def journey(project, sshd, tmp_path_factory):
    base = tmp_path_factory.mktemp("journey")
    clone = base / "clone"
    git(base, "clone", "--quiet", str(project), str(clone))
    # The project as a user would have it with a small config committed, so that the demo takes
    # seconds: `make demo` runs the committed params.
    write_params(clone / "params.yaml", {"train": {"epochs": 1, "save_every_steps": 2}})
    for stage in ("data", "train", "eval"):
        _tool(clone, sys.executable, "-m", f"clipforge.{stage}.config")
    git(clone, "commit", "--quiet", "-am", "a small config")
    steps = {}

    # make demo: `dvc exp run` in the checkout
    demo = _tool(clone, "dvc", "exp", "run")
    name = next(
        line.split("'")[1] for line in demo.stdout.splitlines() if "Reproducing experiment" in line
    )
    steps["demo"] = demo
    steps["apply"] = _tool(clone, "dvc", "exp", "apply", name)
    steps["repro"] = _tool(clone, "dvc", "repro")
    steps["status_git"] = git(clone, "status", "--porcelain")

    fab = make_fab(clone, base / "home", base / "remote", sshd)
    steps["check"] = fab("check", "--gpus", "0", hosts=sshd.address, key=sshd.client_key)
    launch = fab("train", "--gpus", "0", "--smoke", hosts=sshd.address, key=sshd.client_key)
    steps["train"] = launch
    run = LaunchedRun(fab, sshd, base / "remote", launch)

    # `fab status` until it says finished (the limit is a safety net, not a speed assertion)
    deadline = time.monotonic() + 900
    while True:
        status = run.run_fab("status")
        assert status.returncode == 0, status.stderr
        if "finished" in status.stdout or "failed" in status.stdout:
            break
        assert time.monotonic() < deadline, status.stdout
        time.sleep(1)
    steps["status"] = status
    steps["fetch"] = run.run_fab("fetch", "--to", str(base / "runs"))
    return clone, run, base / "runs" / run.launch_id, steps


def test_the_demo_is_an_experiment_whose_apply_leaves_nothing_to_reproduce(journey):
    """`dvc exp apply` then `dvc repro`: no stage runs, the applied model stays."""
    clone, _, _, steps = journey
    assert "Running stage" not in steps["repro"].stdout, steps["repro"].stdout
    assert (clone / "models" / "clip" / "open_clip_model.safetensors").is_file()
    assert any((clone / "logs").iterdir())  # the demo's TensorBoard events, where README says
    # what git sees afterwards: results only (which fab train does not count)
    changed = {line[3:] for line in steps["status_git"].splitlines()}
    assert changed and changed <= {"dvc.lock", "metrics/"}, changed


def test_fab_check_and_train_accept_the_tree_the_demo_left(journey):
    _, run, _, steps = journey
    assert steps["check"].returncode == 0, steps["check"].stdout + steps["check"].stderr
    assert "not committed" not in steps["train"].stderr
    record = json.loads((run.root / "runs" / run.launch_id / "run.json").read_text())
    assert record["commit"] == git(journey[0], "rev-parse", "HEAD").strip()


def test_the_hints_repeat_the_users_host_and_key(journey):
    _, run, _, steps = journey
    hint = next(line for line in steps["train"].stdout.splitlines() if line.startswith("watch it"))
    assert f"fab -H {run.sshd.address} -i {run.sshd.client_key} status" in hint


def test_the_run_evaluates_and_status_shows_the_recall(journey):
    _, run, _, steps = journey
    assert run.state()["state"] == "finished", (run.node_dir / "train.log").read_text()[-3000:]
    plan = json.loads((run.node_dir / "plan.json").read_text())
    assert [p["name"] for p in plan["phases"]] == ["train", "eval", "smoke"]
    rows = steps["status"].stdout
    assert "recall" in rows and "mean " in rows and "smoke" in rows and "passed" in rows


def test_fetch_brings_the_recall_and_the_experiment_home(journey):
    clone, run, fetched, steps = journey
    assert steps["fetch"].returncode == 0, steps["fetch"].stderr
    metrics = json.loads((fetched / "metrics" / "eval.json").read_text())
    assert RECALL_KEYS <= set(metrics["test"])
    info = json.loads((fetched / "metrics" / "eval.info.json").read_text())
    assert info["suites"]["test"]["num_images"] > 0
    shown = json.dumps(json.loads(_tool(clone, "dvc", "exp", "show", "--json").stdout))
    assert str(metrics["mean_over_suites"]) in shown  # the run's experiment, beside the demo's


def test_the_fetched_recall_is_the_eval_stages_on_the_fetched_model(journey, tmp_path):
    """`python -m clipforge.eval` here, on the fetched model and the run's test set (on the
    host, which is this machine), gives the fetched eval.json's numbers exactly."""
    clone, run, fetched, _ = journey
    out = tmp_path / "eval.json"
    _tool(
        clone,
        sys.executable,
        "-m",
        "clipforge.eval",
        "--model",
        f"local-dir:{fetched / 'models' / 'clip'}",
        "--data",
        str(run.code / "data" / "test"),
        "--out",
        str(out),
    )
    here = json.loads(out.read_text())
    there = json.loads((fetched / "metrics" / "eval.json").read_text())
    assert here["test"] == {k: there["test"][k] for k in RECALL_KEYS}
