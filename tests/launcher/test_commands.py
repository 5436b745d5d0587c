"""The commands a run is made of, checked as data; DeepSpeed's own parsers check the launcher's.

The docker runtime cannot run here (no Docker engine): its `docker run` is checked for what it
must carry (GPU device request, mounts, env, shm size, user), not executed.
"""

from __future__ import annotations

import pytest

from clipforge.errors import LauncherError
from clipforge.fault_record import FAULT_RECORD_ENV
from clipforge.launcher.commands import (
    DockerSpec,
    NodeContext,
    docker_run_argv,
    docker_stop_argv,
    hostfile_text,
    multinode_train_argv,
    node_plan,
)
from clipforge.launcher.host.plan import PASSTHROUGH_ENV, RestartPolicy
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.options import make_options, resolve_params
from clipforge.pipeline.params_file import render
from clipforge.pipeline.recipe import recipe_params
from clipforge.store.remote import RUN_RECORD_ENV
from clipforge.train.config import batch_plan
from tests.conftest import REPO

POLICY = RestartPolicy(
    max_restarts=5, backoff_seconds=1, backoff_max_seconds=2, stop_timeout_seconds=9
)
PY = "/opt/venv/bin/python"


def _options(**changes):
    values = dict(
        gpus=4, nodes=1, sets=[], smoke=False, runtime="host", allow_dirty=False, data="build"
    )
    values.update(changes)
    return make_options(**values)


def _node(rank=0, hosts=("a", "b")):
    return NodeContext(
        layout=NodeLayout(
            root="/srv/runs-root", launch_id="20260101-000000-abcdef12", node_rank=rank
        ),
        hosts=list(hosts),
        master_addr="10.0.0.1",
        host_python=PY,
        user="1000:1000",
        image="registry.example/clipforge:tag",
        shm_size="16g",
    )


def _spec(**changes):
    values = dict(
        image="registry.example/clipforge:tag",
        name="clipforge-x-n0-train",
        gpus=4,
        user="1000:1000",
        run_dir="/srv/r/runs/x",
        workdir="/srv/r/runs/x/node-0/code",
        home="/srv/r/runs/x/node-0/home",
        shm_size="16g",
    )
    values.update(changes)
    return DockerSpec(**values)


def _pairs(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_single_node_trains_through_dvc_with_every_set_as_dash_s():
    """One node, DVC-managed data: `dvc exp run -S ... train`, --gpus as ranks per node, --set last."""
    plan = node_plan(_options(sets=["train.lr=0.0005"]), _node(), POLICY)
    assert [p.name for p in plan.phases] == ["train", "eval"]
    argv = plan.phases[0].argv
    assert argv[:5] == [PY, "-m", "dvc", "exp", "run"] and argv[-1] == "train"
    assert _pairs(argv, "-S") == ["train.num_nodes=1", "train.ranks_per_node=4", "train.lr=0.0005"]


def test_the_run_evaluates_through_dvc_with_the_same_params():
    """After train, `dvc exp run -S ... eval` with the very same -S (so train stays up to date):
    the exported model on the recipe's test set, restarted like any phase."""
    plan = node_plan(_options(sets=["train.lr=0.0005"]), _node(), POLICY)
    train, evaluate = plan.phases
    assert evaluate.argv == train.argv[:-1] + ["eval"] and evaluate.restartable


def test_without_dvc_node_0_evaluates_the_exported_model_on_every_suite_of_the_runs_data():
    """Mounted data or several nodes: `python -m clipforge.eval` on every eval suite, those under
    data/ read from the run's data, on node 0 only (rank 0 exported the model into its
    checkout)."""
    mounted = node_plan(_options(data="/mnt/datasets/zh"), _node(), POLICY).phases
    assert [p.name for p in mounted] == ["train", "eval"]
    assert mounted[1].argv[:3] == [PY, "-m", "clipforge.eval"]
    assert _pairs(mounted[1].argv, "--data-root") == ["/mnt/datasets/zh"]
    assert "--data" not in mounted[1].argv  # not the one-set mode: every suite is scored
    node_1 = node_plan(_options(nodes=2, gpus=8), _node(rank=1), POLICY).phases
    assert [p.name for p in node_1] == ["data", "train"]
    node_0 = node_plan(_options(nodes=2, gpus=8), _node(rank=0), POLICY).phases
    assert _pairs(node_0[2].argv, "--data-root") == [
        "/srv/runs-root/runs/20260101-000000-abcdef12/node-0/code/data"
    ]


def test_gpus_0_is_a_cpu_run():
    """--gpus 0: device cpu, one rank, DS_ACCELERATOR=cpu in the phase's environment (beside the
    path of the run's record, which the train stage copies to the run store)."""
    node = _node()
    plan = node_plan(_options(gpus=0), node, POLICY)
    assert {"train.device=cpu", "train.ranks_per_node=1"} <= set(_pairs(plan.phases[0].argv, "-S"))
    assert plan.phases[0].env == {
        "DS_ACCELERATOR": "cpu",
        RUN_RECORD_ENV: node.layout.record,
        FAULT_RECORD_ENV: node.layout.fault_record,
    }


def test_pull_fetches_the_data_first_and_smoke_reloads_last():
    """--data pull adds a `dvc pull data` phase; --smoke a final, non-restartable reload check,
    after eval (a smoke run is evaluated too)."""
    plan = node_plan(_options(data="pull", smoke=True), _node(), POLICY)
    assert [p.name for p in plan.phases] == ["data", "train", "eval", "smoke"]
    assert plan.phases[0].argv == [PY, "-m", "dvc", "pull", "data"]
    smoke = plan.phases[3]
    assert not smoke.restartable and smoke.argv[smoke.argv.index("--") + 1 :] == [
        PY,
        "-m",
        "clipforge.train",
    ]
    assert "train.max_steps=4" in _pairs(plan.phases[1].argv, "-S")


def test_mounted_data_bypasses_dvc():
    """--data /path: the stage runs directly on the volume (never inside the DVC workspace)."""
    plan = node_plan(_options(data="/mnt/datasets/zh"), _node(), POLICY)
    argv = plan.phases[0].argv
    assert argv[:3] == [PY, "-m", "clipforge.train"] and _pairs(argv, "--data") == [
        "/mnt/datasets/zh"
    ]


def test_multinode_argv_parses_with_deepspeeds_own_runner():
    """Each node's launcher command is valid for deepspeed.launcher.runner: no-SSH mode, its node
    rank, the node count, GPUs per node, node 0 as master, the shared checkpoints."""
    from deepspeed.launcher.runner import parse_args

    argv = multinode_train_argv(
        PY,
        node_rank=1,
        num_nodes=2,
        ranks_per_node=8,
        master_addr="10.0.0.1",
        master_port=29511,
        hostfile="/r/hostfile",
        overrides=("train.lr=1",),
        data_dir="/r/node-1/code/data",
        checkpoints_dir="/r/checkpoints",
    )
    assert argv[:3] == [PY, "-m", "deepspeed.launcher.runner"]
    args = parse_args(argv[3:])
    assert args.no_ssh and args.node_rank == 1 and args.num_nodes == 2 and args.num_gpus == 8
    assert args.master_addr == "10.0.0.1" and args.master_port == 29511 and args.module
    assert args.no_local_rank and args.hostfile == "/r/hostfile"
    assert args.user_script == "clipforge.train"
    assert args.user_args == [
        "--set",
        "train.lr=1",
        "--data",
        "/r/node-1/code/data",
        "--checkpoints",
        "/r/checkpoints",
    ]


def test_hostfile_lists_every_node_with_its_slots(tmp_path):
    """The hostfile parses with DeepSpeed's reader: one entry per node, GPUs per node as slots."""
    from deepspeed.launcher.runner import fetch_hostfile

    path = tmp_path / "hostfile"
    path.write_text(hostfile_text(["a", "b", "c"], 4))
    assert dict(fetch_hostfile(str(path))) == {"node-0": 4, "node-1": 4, "node-2": 4}


def test_multinode_plan_builds_data_then_launches_its_rank():
    """--nodes 2 --data build: each node builds the data stage, then runs its own launcher."""
    plan = node_plan(_options(nodes=2, gpus=8), _node(rank=1), POLICY)
    assert [p.name for p in plan.phases] == ["data", "train"]
    assert plan.phases[0].argv[-1] == "data"
    train = plan.phases[1].argv
    assert _pairs(train, "--node_rank") == ["1"] and _pairs(train, "--master_addr") == ["10.0.0.1"]
    assert _pairs(train, "--checkpoints") == [
        "/srv/runs-root/runs/20260101-000000-abcdef12/checkpoints"
    ]


def test_docker_run_requests_gpus_mounts_env_shm_and_user():
    """docker run: a device request for the GPUs, the run dir at the same path, the data read-only,
    /dev/shm size, the SSH user's uid:gid, host network, HOME and PYTHONPATH of the run."""
    argv = docker_run_argv(_spec(data_dir="/mnt/data"), ["python", "-m", "clipforge.train"])
    assert argv[:4] == ["docker", "run", "--rm", "--init"]
    assert _pairs(argv, "--gpus") == ["4"] and _pairs(argv, "--shm-size") == ["16g"]
    assert _pairs(argv, "--user") == ["1000:1000"] and _pairs(argv, "--network") == ["host"]
    assert _pairs(argv, "--volume") == ["/srv/r/runs/x:/srv/r/runs/x", "/mnt/data:/mnt/data:ro"]
    assert "memlock=-1" in _pairs(argv, "--ulimit")  # pinned memory for CUDA and NCCL
    env = _pairs(argv, "--env")
    assert (
        "HOME=/srv/r/runs/x/node-0/home" in env
        and "PYTHONPATH=/srv/r/runs/x/node-0/code/src" in env
    )
    image_at = argv.index("registry.example/clipforge:tag")
    assert argv[image_at + 1 :] == ["python", "-m", "clipforge.train"]


def test_docker_phases_get_secrets_on_stdin_by_name_only(monkeypatch):
    """The alert webhooks and the run store's credentials reach a docker phase through its stdin
    (the supervisor writes them, the entrypoint reads them): the command line names them and
    holds no value."""
    monkeypatch.setenv("CLIPFORGE_ALERT_WEBHOOKS", "slack:https://hooks.example/secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "store-secret")
    phase = node_plan(_options(runtime="docker"), _node(), POLICY).phases[0]
    assert "--interactive" in phase.argv
    names = ",".join(PASSTHROUGH_ENV)
    assert f"CLIPFORGE_ENV_FROM_STDIN={names}" in _pairs(phase.argv, "--env")
    assert phase.stdin_env == list(PASSTHROUGH_ENV)
    assert {"CLIPFORGE_ALERT_WEBHOOKS", "AWS_SECRET_ACCESS_KEY"} <= set(PASSTHROUGH_ENV)
    assert not any("secret" in a for a in phase.argv)


def test_docker_cpu_run_has_no_device_request():
    """--gpus 0 under docker: no --gpus, DS_ACCELERATOR=cpu inside."""
    plan = node_plan(_options(gpus=0, runtime="docker"), _node(), POLICY)
    argv = plan.phases[0].argv
    assert "--gpus" not in argv and "DS_ACCELERATOR=cpu" in _pairs(argv, "--env")
    assert not any(limit.startswith("memlock") for limit in _pairs(argv, "--ulimit"))
    assert argv[argv.index("registry.example/clipforge:tag") + 1 :][:3] == ["python", "-m", "dvc"]


def test_docker_phases_stop_and_clean_their_container():
    """A docker phase is stopped by SIGINT to the processes inside its container, and a leftover
    container of the same name is removed before each attempt."""
    plan = node_plan(_options(runtime="docker"), _node(), POLICY)
    phase = plan.phases[0]
    name = _pairs(phase.argv, "--name")[0]
    assert name == "clipforge-20260101-000000-abcdef12-n0-train"
    assert (
        phase.stop_argv
        == docker_stop_argv(name)
        == ["docker", "exec", name, "sh", "-c", "kill -INT -1"]
    )
    assert phase.cleanup_argv == ["docker", "rm", "--force", name]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"gpus": -1}, "--gpus"),
        ({"nodes": 0}, "--nodes"),
        ({"runtime": "podman"}, "--runtime"),
        ({"data": "relative/path"}, "--data"),
        ({"sets": ["train.num_nodes=2"]}, "--gpus/--nodes"),
        ({"sets": ["lr"]}, "--set lr"),
    ],
)
def test_bad_options_are_refused_by_name(changes, message):
    """Each bad option fails with a message naming it."""
    with pytest.raises(LauncherError, match=message.replace("/", ".")):
        _options(**changes)


@pytest.mark.parametrize("recipe", ["default", "production"])
@pytest.mark.parametrize("gpus, nodes", [(0, 1), (1, 1), (4, 1), (8, 1), (0, 2), (4, 2), (8, 4)])
def test_the_committed_params_resolve_on_any_gpus_and_nodes(recipe, gpus, nodes):
    """`fab train --gpus N [--nodes N]` on the committed params, as they are or with the
    production recipe written in: the global batch holds, each rank takes its share."""
    options = _options(gpus=gpus, nodes=nodes, sets=[])
    params = render(recipe_params(recipe).to_dict())
    config = resolve_params(params, options.overrides)
    plan = batch_plan(config.train)
    assert plan.world_size == nodes * max(gpus, 1)
    assert plan.global_batch_size == (4096 if recipe == "production" else 128)
    assert plan.micro_batch_size * plan.world_size * plan.grad_accum_steps == plan.global_batch_size


def test_a_recipe_set_on_the_command_line_is_refused_with_the_command_that_writes_it():
    """`fab train --set recipe=production` is refused on the laptop in one line: what runs is
    the committed params.yaml, into which the recipe is written and committed first."""
    options = _options(sets=["recipe=production"])
    with pytest.raises(LauncherError) as refused:
        resolve_params((REPO / "params.yaml").read_text(), options.overrides)
    message = str(refused.value)
    assert (
        message.startswith("params: recipe: --set recipe names production") and "\n" not in message
    )
    assert "`python -m clipforge.pipeline.recipe production`" in message


@pytest.mark.parametrize("gpus, nodes", [(0, 1), (3, 1), (4, 1), (0, 3), (6, 2)])
def test_smoke_takes_a_batch_every_world_divides(gpus, nodes):
    """--smoke: 16 pairs per rank whatever the world (3 GPUs included, which 128 would not
    split), over committed params that set their own micro batch; a user --set still wins."""
    params = (
        (REPO / "params.yaml")
        .read_text()
        .replace("micro_batch_size: auto", "micro_batch_size: 128")
    )
    options = _options(gpus=gpus, nodes=nodes, smoke=True)
    plan = batch_plan(resolve_params(params, options.overrides).train)
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (16, 1)
    assert plan.global_batch_size == 16 * nodes * max(gpus, 1)
    mine = _options(gpus=gpus, nodes=nodes, smoke=True, sets=["train.max_steps=6"])
    assert resolve_params(params, mine.overrides).train.max_steps == 6
