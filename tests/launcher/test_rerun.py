"""`fab rerun` of a fetched smoke run on the real sshd: a new launch of the same commit, params and
runtime, which says in its run record what it repeats, and which `fab compare` calls identical."""

from __future__ import annotations

import json

import pytest

from tests.launcher.conftest import LaunchedRun

pytestmark = pytest.mark.tier2


def test_a_fetched_smoke_run_rerun_on_the_host_is_identical_to_it(smoke_run, project):
    original = smoke_run.launch_id
    fetched = smoke_run.run_fab("fetch", "--launch", original)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr

    # the line the model card prints, as it prints it (runs/<launch id> as `fab fetch` left it)
    card = (project / "runs" / original / "models" / "clip" / "README.md").read_text()
    assert f"fab rerun {original}   #" in card
    launched = smoke_run.run_fab("rerun", original)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert f"rerun of {original}" in launched.stdout
    rerun = LaunchedRun(smoke_run.fab, smoke_run.sshd, smoke_run.root, launched)
    assert rerun.launch_id != original
    final = rerun.wait_finished()
    assert final["state"] == "finished", (rerun.node_dir / "train.log").read_text()[-4000:]

    record = json.loads((smoke_run.root / "runs" / rerun.launch_id / "run.json").read_text())
    assert record["repeats"]["launch_id"] == original
    first = json.loads((smoke_run.root / "runs" / original / "run.json").read_text())
    assert record["commit"] == first["commit"] and record["params"] == first["params"]
    assert record["overrides"] == first["overrides"] and record["runtime"] == first["runtime"]

    fetched = smoke_run.run_fab("fetch", "--launch", rerun.launch_id)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    info = [
        json.loads((project / "runs" / launch / "metrics" / "train.info.json").read_text())
        for launch in (original, rerun.launch_id)
    ]
    assert info[0]["run_id"] != info[1]["run_id"]  # trained anew, not resumed from the first
    assert info[1]["resumed_from_step"] == 0
    compared = smoke_run.fab("compare", original, rerun.launch_id)  # launch ids under runs/
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "verdict: identical" in compared.stdout

    # the forms docs/launcher.md shows beside it: the fetched folder, --allow-stack-change (the
    # same stack here, so nothing to allow); launched as a rerun of the same run, then stopped
    other = smoke_run.run_fab("rerun", f"runs/{original}", "--allow-stack-change")
    assert f"rerun of runs/{original} (launch {original})" in other.stdout, other.stderr
    stopping = LaunchedRun(smoke_run.fab, smoke_run.sshd, smoke_run.root, other)
    stopped = stopping.run_fab("stop", "--launch", stopping.launch_id)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert stopping.state()["state"] == "stopped"
