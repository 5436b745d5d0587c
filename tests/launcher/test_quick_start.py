"""The quick starts of README.md and docs/launcher.md, as documented, on this machine's sshd.

Each documented command runs with the committed params and the documented flags only, `--gpus 0`
standing for `--gpus 4` (no GPU here): (a) a GPU box of your own over SSH, `--runtime host` (the
default); (c) the workers of the Kubernetes stack, read from the stack outputs that `make up`
writes (here two workers: this machine under two names, the run root on a directory standing
for the retained checkpoints volume), with `--nodes 2` for a run of several ranks. `--gpus 4`
itself goes as far as it can without a GPU: the params resolve, and the preflight stops at its
GPU row, every other row passing. (b), `--runtime docker`, needs a Docker engine.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from clipforge.pipeline.recipe import main as recipe_main
from tests.conftest import git
from tests.launcher.conftest import LaunchedRun, make_fab, wait_for_end
from tests.support.hostprocs import processes_under
from tests.support.sshd import free_port

pytestmark = pytest.mark.slow
# The two documented smoke runs (a minute and a half each) are in make test-tier3. Own box's
# repeats the journey's (tier2, test_journey.py: the same `fab check` and `fab train --gpus 0
# --smoke`, then status and fetch); the stack's two nodes, the two-node runs over SSH (tier2,
# test_multinode.py). make test keeps the --gpus 4 refusals on both (below) and a real run
# launched, watched and fetched through `fab` (test_smoke_run.py).
tier3 = pytest.mark.tier3


def _rows(output: str) -> dict[str, list[str]]:
    """Preflight rows `name  status  detail` -> statuses, by row name (one per host)."""
    rows: dict[str, list[str]] = {}
    for match in re.finditer(r"^  (\w[\w ]*?)\s{2,}(ok|FAIL|skip)\s", output, re.MULTILINE):
        rows.setdefault(match.group(1), []).append(match.group(2))
    return rows


# -- (a) a GPU box of your own, over SSH ---------------------------------------------------------
@pytest.fixture(scope="module")
def own_box(project, sshd, tmp_path_factory) -> LaunchedRun:
    """`fab -H me@box -i KEY check`, then `fab -H me@box -i KEY train --gpus 0 --smoke`."""
    base = tmp_path_factory.mktemp("own-box")
    fab = make_fab(project, base / "home", base / "remote", sshd)
    check = fab("check", "--gpus", "0", hosts=sshd.address, key=sshd.client_key)
    launch = fab("train", "--gpus", "0", "--smoke", hosts=sshd.address, key=sshd.client_key)
    run = LaunchedRun(fab, sshd, base / "remote", launch)
    run.check, run.final = check, run.wait_finished()
    return run


@tier3
def test_own_box_check_passes_with_the_default_runtime(own_box):
    """`fab check`: the host runtime (the default) finds the Python stack; every row passes."""
    assert own_box.check.returncode == 0, own_box.check.stdout + own_box.check.stderr
    rows = _rows(own_box.check.stdout)
    assert rows["python env"] == ["ok"] and "docker" not in rows


@tier3
def test_own_box_smoke_trains_on_the_defaults(own_box):
    """`fab train --gpus 0 --smoke`: no DVC remote in the commit, so the data stage runs on the
    host, saying so; the smoke run takes 16 pairs per rank of the embedded default and passes."""
    assert "the data stage runs on the host (--data build)" in own_box.launch.stdout
    assert own_box.final["state"] == "finished", (own_box.node_dir / "train.log").read_text()[
        -3000:
    ]
    record = json.loads((own_box.root / "runs" / own_box.launch_id / "run.json").read_text())
    assert (record["runtime"], record["data"]) == ("host", "build")
    assert record["params"]["train"]["global_batch_size"] == 16
    assert record["params"]["model"]["name"] == "clipforge-tiny"  # the embedded default
    assert json.loads((own_box.node_dir / "smoke.json").read_text())["passed"]


@tier3
def test_own_box_status_logs_and_fetch(own_box, tmp_path):
    """`fab status --price-per-gpu-hour`, `fab logs --follow`, `fab fetch` on the finished run."""
    status = own_box.run_fab("status", "--price-per-gpu-hour", "1.85")
    assert status.returncode == 0 and "4/4" in status.stdout and "passed" in status.stdout
    logs = own_box.run_fab("logs", "--follow")
    assert logs.returncode == 0 and "smoke: PASSED" in logs.stdout
    fetched = own_box.run_fab("fetch", "--to", str(tmp_path))
    assert fetched.returncode == 0, fetched.stderr
    assert (
        tmp_path / own_box.launch_id / "models" / "clip" / "open_clip_model.safetensors"
    ).is_file()


# -- (c) the Kubernetes stack's workers ----------------------------------------------------------
@pytest.fixture(scope="module")
def stack(project, sshd, tmp_path_factory):
    """A stack outputs file as `make up` writes it, whose two workers are this machine, reached
    from inside the cluster (no port-forward); fab run without -H or -i, the user's key being
    the default one, and the run root left to its default on the checkpoints volume."""
    base = tmp_path_factory.mktemp("stack")
    volumes = {role: base / "volumes" / role for role in ("datasets", "checkpoints", "logs")}
    for path in volumes.values():
        path.mkdir(parents=True)
    outputs = base / "stack-outputs.json"
    outputs.write_text(
        json.dumps(
            {
                "namespace": "clipforge",
                "released": False,
                "gpus_per_worker": 4,
                "workers": [
                    {"pod": "clipforge-worker-0", "host": "127.0.0.1"},
                    {"pod": "clipforge-worker-1", "host": "localhost"},
                ],
                "ssh": {
                    "user": sshd.user,
                    "port": sshd.port,
                    "host_public_key": sshd.host_public_key,
                },
                "volumes": {
                    role: {"mount_path": str(path), "retained": True}
                    for role, path in volumes.items()
                },
                "cost": {"price_per_gpu_hour": "1.85"},
            }
        )
    )
    fab = make_fab(project, base / "home", volumes["checkpoints"] / "clipforge-runs", sshd)
    del fab.env["FABRIC_CLIPFORGE_REMOTE_ROOT"]
    fab.env.update(
        {"FABRIC_CLIPFORGE_STACK_OUTPUTS": str(outputs), "CLIPFORGE_SSH_GATEWAY": "none"}
    )
    shutil.copy(sshd.client_key, base / "home" / ".ssh" / "id_ed25519")
    return fab, volumes["checkpoints"] / "clipforge-runs"


@pytest.fixture(scope="module")
def stack_run(stack, sshd) -> LaunchedRun:
    """`fab check --gpus 0`, then `fab train --gpus 0 --nodes 2 --smoke` on the stack."""
    fab, root = stack
    check = fab("check", "--gpus", "0")
    launch = fab(
        "train", "--gpus", "0", "--nodes", "2", "--smoke", "--master-port", str(free_port())
    )
    run = LaunchedRun(fab, sshd, root, launch)
    run.run_fab = lambda *args, **kwargs: fab(*args, **kwargs)  # the stack's hosts: no -H
    run.check, run.final = check, run.wait_finished()
    run.node1_final = wait_for_end(root / "runs" / run.launch_id / "node-1")
    return run


@tier3
def test_stack_check_preflights_every_worker(stack_run):
    """`fab check`: both workers, each with its volumes mounted and writable."""
    assert stack_run.check.returncode == 0, stack_run.check.stdout + stack_run.check.stderr
    rows = _rows(stack_run.check.stdout)
    assert rows["ssh"] == ["ok", "ok"] and rows["volume checkpoints"] == ["ok", "ok"]


@tier3
def test_stack_smoke_runs_two_ranks_on_the_retained_volume(stack_run):
    """`fab train --gpus 0 --nodes 2 --smoke`: one rank per worker, both supervisors finish, the
    run and its shared checkpoints live on the checkpoints volume, the smoke passes on node 0."""
    assert stack_run.final["state"] == "finished", (stack_run.node_dir / "train.log").read_text()[
        -3000:
    ]
    assert stack_run.node1_final["state"] == "finished"
    shared = stack_run.root / "runs" / stack_run.launch_id / "checkpoints"
    assert list(shared.glob("run-*/latest"))
    record = json.loads((stack_run.root / "runs" / stack_run.launch_id / "run.json").read_text())
    assert record["params"]["train"]["global_batch_size"] == 32  # 16 pairs x 2 ranks
    assert json.loads((stack_run.node_dir / "smoke.json").read_text())["passed"]


@tier3
def test_stack_status_and_fetch(stack_run, tmp_path):
    """`fab status` and `fab fetch` without -H: the stack's workers."""
    status = stack_run.run_fab("status")
    assert status.returncode == 0, status.stderr
    assert "2 nodes x CPU" in status.stdout and "4/4" in status.stdout
    fetched = stack_run.run_fab("fetch", "--to", str(tmp_path))
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / stack_run.launch_id / "metrics" / "train.json").is_file()


# -- --gpus 4 without a GPU ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def production_project(project, tmp_path_factory) -> Path:
    """The project with the production recipe written into params.yaml and committed, as the
    quick start has it done before `fab train`."""
    root = tmp_path_factory.mktemp("production") / "project"
    git(root.parent, "clone", "--quiet", str(project), str(root))
    assert recipe_main(["production", "--params", str(root / "params.yaml")]) == 0
    git(root, "commit", "--quiet", "-am", "the production recipe")
    return root


@pytest.mark.parametrize(
    ("production", "args"),
    [
        (False, ("train", "--gpus", "4")),
        (True, ("train", "--gpus", "4")),
        (False, ("train", "--gpus", "4", "--smoke", "--data", "build")),
    ],
    ids=["default", "production", "smoke"],
)
def test_gpus_4_on_own_box_stops_only_at_the_gpu_row(
    fab, production_project, sshd, remote_root, production, args
):
    """The documented `fab train --gpus 4 ...` (on the production recipe, written into
    params.yaml and committed): the params resolve (no params error), and the preflight fails on
    its GPU row alone; nothing is started."""
    if production:
        fab = dataclasses.replace(fab, project=production_project)
    result = fab(*args, hosts=sshd.address, key=sshd.client_key)
    assert result.returncode == 1 and "preflight failed" in result.stderr, result.stderr
    rows = _rows(result.stdout)
    assert rows.pop("gpus") == ["FAIL"] and all(s == ["ok"] for s in rows.values()), result.stdout
    assert "--gpus 4 asked" in result.stdout
    assert not (remote_root / "runs").exists() and processes_under(remote_root.parent) == []


def test_gpus_4_on_the_stack_stops_only_at_the_gpu_rows(stack, production_project):
    """On the stack: `fab check` (the stack's 4 GPUs per worker), and the documented `fab train
    --gpus 4 ...` on both workers (the production recipe written and committed for the last):
    every worker's GPU row fails, nothing else."""
    fab, root = stack
    production = dataclasses.replace(fab, project=production_project)
    for runner, args in (
        (fab, ("check",)),
        (fab, ("train", "--gpus", "4", "--smoke", "--data", "build", "--nodes", "2")),
        (production, ("train", "--gpus", "4", "--nodes", "2")),
    ):
        result = runner(*args)
        assert result.returncode == 1, result.stdout + result.stderr
        rows = _rows(result.stdout)
        assert rows.pop("gpus") == ["FAIL", "FAIL"], result.stdout
        assert all(set(s) == {"ok"} for s in rows.values()), result.stdout
