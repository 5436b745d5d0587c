"""Fewer GPUs, same run, on several nodes: every node runs the same number of ranks, so when one
node loses a GPU they all go on with the ranks the fewest GPUs left allow (clipforge.launcher.
host.gpus.agree), decided by node 0's supervisor on every node's count (the run's shared
storage) before each attempt of the train phase.

First the rule and the commands (pure), then two real supervisors agreeing on shell commands
that stand for the train stage (seconds), then a real 2 nodes x 2 ranks CPU run in two network
namespaces that loses "GPU 1" on node b mid-run and finishes on 2 nodes x 1 rank, compared with
an uninterrupted run of the same world size and global batch (tier2)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from clipforge.launcher.commands import hostfile_text, multinode_train_argv, node_plan
from clipforge.launcher.host.gpus import (
    FAULT_FILE,
    GpuRecordError,
    GpuReport,
    agree,
    decide,
    parse_report,
    spanning_attempt_argv,
)
from clipforge.launcher.host.plan import Phase, PhasePlan, RestartPolicy
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.status import collect, summarize
from clipforge.launcher.host.supervisor import MODULE
from clipforge.progress import read_progress
from tests.conftest import subprocess_env, train_argv, write_params
from tests.support.netns import LAPTOP_ADDRESS, made_in_namespace
from tests.support.records import run_record
from tests.support.same_run import assert_same_run
from tests.support.wait import wait_for
from tests.support.webhooks import WebhookServer


# -- the rule ------------------------------------------------------------------------------------
def test_every_node_goes_on_with_the_ranks_the_fewest_gpus_left_allow():
    """The largest divisor of the planned count per node not above the fewest left anywhere:
    nodes x ranks then divides the planned world, so the global batch keeps its micro batch."""
    assert agree(8, {0: 8, 1: 8}, 4).ranks == 8
    assert [agree(8, {0: 8, 1: left}, 1).ranks for left in (7, 6, 5, 4, 3, 2, 1)] == [
        4, 4, 4, 4, 2, 2, 1,
    ]  # fmt: skip
    assert agree(8, {0: 7, 1: 8, 2: 3}, 1).ranks == 2  # the fewest of any node
    two = agree(2, {0: 2, 1: 1}, 1)
    assert two.ranks == 1
    assert two.message == (
        "node 1 has 1 of 2: every node goes on with 1 of 2 rank(s), the same global batch"
    )
    floor = agree(8, {0: 8, 1: 5}, 5)  # 5 left, but 4 keep the global batch
    assert floor.ranks == 0
    assert "4 per node keep the global batch, fewer than --min-gpus=5" in floor.message
    assert agree(2, {0: 0, 1: 2}, 1).ranks == 0


def _report(rank: int, usable: tuple[int, ...], seq: int = 1) -> GpuReport:
    return GpuReport(node_rank=rank, host=f"h{rank}", seq=seq, usable=usable, source="x", at=1.0)


def test_node_0s_decision_names_the_report_it_took_from_each_node():
    decision = decide(2, {0: _report(0, (0, 1), 3), 1: _report(1, (1,), 5)}, 1)
    assert (decision.ranks, decision.seen) == (1, {"0": 3, "1": 5})
    assert decision.usable == {"0": [0, 1], "1": [1]}
    assert decision.hosts == {"0": "h0", "1": "h1"}
    report = _report(1, (0, 2))
    assert parse_report(report.to_json(), "r.json") == report
    with pytest.raises(GpuRecordError, match="r.json: not JSON"):
        parse_report('{"node_rank": 1', "r.json")
    with pytest.raises(GpuRecordError, match="r.json: usable is"):
        parse_report(report.to_json().replace("[\n    0,\n    2\n  ]", '["0"]'), "r.json")


def test_an_agreed_attempt_names_every_nodes_ranks_to_deepspeeds_launcher():
    """On the host: --include with this node's GPUs (DeepSpeed sets each rank's devices from it),
    the other nodes' lists only as long as their ranks. In a container: the count."""
    argv = multinode_train_argv(
        "python",
        node_rank=1,
        num_nodes=2,
        ranks_per_node=4,
        master_addr="10.0.0.1",
        master_port=29500,
        hostfile="/r/hostfile",
        overrides=(),
        data_dir="/d",
        checkpoints_dir="/c",
    )
    shrunk = spanning_attempt_argv(argv, 2, (1, 3), node_rank=1, num_nodes=2)
    assert "--num_gpus" not in shrunk and "--num_nodes" not in shrunk
    at = shrunk.index("--include")
    assert shrunk[at + 1] == "node-0:0,1@node-1:1,3"
    assert [a for a in shrunk if a not in ("--include", shrunk[at + 1])] == [
        a for a in argv if a not in ("--num_nodes", "--num_gpus", "2", "4")
    ]
    assert hostfile_text(["a", "b"], 4) == "node-0 slots=4\nnode-1 slots=4\n"
    docker = ["docker", "run", "--gpus", "4", "image", *argv]
    inside = spanning_attempt_argv(docker, 2, (1, 3), node_rank=1, num_nodes=2)
    assert inside[inside.index("--num_gpus") + 1] == "2"
    assert inside[inside.index("--gpus") + 1] == '"device=1,3"'
    assert "--num_nodes" in inside  # inside the container the launcher is asked as before


def test_only_the_train_phase_of_several_nodes_is_agreed_on_and_one_node_plans_lack_the_key():
    """The multi-node train phase spans the nodes; the data phase (each node's own) and a
    single node's plan do not, and their plan.json has no such key (an older commit's
    supervisor, which a run moved from the store runs, reads it)."""
    from tests.launcher.test_commands import POLICY, _node, _options

    phases = node_plan(_options(nodes=2, gpus=8), _node(rank=1), POLICY).phases
    assert [(p.name, p.spans_nodes) for p in phases] == [("data", False), ("train", True)]
    assert PhasePlan.from_json(PhasePlan(phases=phases, policy=POLICY).to_json()).phases == phases
    one = PhasePlan(phases=node_plan(_options(), _node(), POLICY).phases, policy=POLICY)
    assert "spans_nodes" not in one.to_json()


# -- two supervisors agreeing (shell commands for the stage) -------------------------------------
# The first attempt of each node crashes (node 1 "loses" GPU 1 as it does: the fault hook), as a
# rank dying ends every node's attempt; the next ones write down what they were given.
_STAGE = f"""
import json, os, pathlib, sys
node = pathlib.Path.cwd()
if not (node / "attempted").exists():
    (node / "attempted").touch()
    if node.name == "node-1":
        (node / {FAULT_FILE!r}).write_text("0\\n")
    sys.exit(1)
given = {{"argv": sys.argv[1:], "ranks": os.environ.get("CLIPFORGE_RANKS_PER_NODE")}}
(node / "given.json").write_text(json.dumps(given))
"""


def _two_nodes(root: Path, argv_tail: list[str], min_gpus: int | None = None) -> list[NodeLayout]:
    nodes = [NodeLayout(root=str(root), launch_id="run", node_rank=r) for r in (0, 1)]
    record = run_record(launch_id="run", num_nodes=2, gpus_per_node=2, hosts=("a", "b"))
    policy = RestartPolicy(
        max_restarts=2,
        backoff_seconds=0.1,
        backoff_max_seconds=0.2,
        stop_timeout_seconds=30,
        min_gpus=min_gpus,
    )
    for node in nodes:
        Path(node.node_dir).mkdir(parents=True)
        (Path(node.node_dir) / FAULT_FILE).write_text("0\n1\n")
        phase = Phase(
            name="train",
            argv=[sys.executable, "-c", _STAGE, *argv_tail],
            cwd=node.node_dir,
            spans_nodes=True,
        )
        phases = [phase]
        if node.node_rank == 0:  # node 0's own eval after training: not agreed on
            script = "echo ${CLIPFORGE_RANKS_PER_NODE:-as planned} > eval.txt"
            phases.append(Phase(name="eval", argv=["sh", "-c", script], cwd=node.node_dir))
        Path(node.plan).write_text(PhasePlan(phases=phases, policy=policy).to_json())
    Path(nodes[0].record).write_text(record.to_json())
    return nodes


def _start(node: NodeLayout, env: dict | None = None, prefix: tuple[str, ...] = ()):
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", MODULE, "run", node.node_dir],
        env={**subprocess_env(), **(env or {})},
        cwd=node.node_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )


def _state(node: NodeLayout) -> dict:
    return json.loads(Path(node.state).read_text())


def _log(node: NodeLayout) -> str:
    return Path(node.train_log).read_text()


def test_two_nodes_agree_on_one_rank_each_when_node_1_loses_a_gpu(tmp_path, webhook):
    """Node 1 loses GPU 1 during attempt 1: both restart with 1 rank, named to DeepSpeed's
    launcher; one gpu_lost alert (node 1's, naming its host and device); `fab status` of node 0
    says which node lost what and what every node went on with, also after node 0's eval."""
    nodes = _two_nodes(tmp_path, ["--num_nodes", "2", "--num_gpus", "2"])
    env = {"CLIPFORGE_ALERT_WEBHOOKS": webhook.url()}
    supervisors = [_start(node, env) for node in reversed(nodes)]  # node 1 first: it waits
    assert [s.wait(timeout=120) for s in supervisors] == [0, 0], _log(nodes[0])[-2000:]
    for node in nodes:
        state = _state(node)
        assert state["state"] == "finished" and state["restarts"] == 1, _log(node)[-2000:]
        assert (state["gpus"]["ranks"], state["gpus"]["ranks_before"]) == (1, 2)
        given = json.loads((Path(node.node_dir) / "given.json").read_text())
        assert given == {"argv": ["--include", "node-0:0@node-1:0"], "ranks": "1"}
    decision = json.loads(Path(nodes[0].gpu_decision).read_text())
    assert (decision["ranks"], decision["seen"]) == (1, {"0": 2, "1": 2})
    (alert,) = [r.body for r in webhook.received if r.body["rule"] == "gpu_lost"]
    assert alert["severity"] == "warning" and alert["host"] == socket.gethostname()
    assert alert["message"].startswith(f"node 1 ({socket.gethostname()}): GPU 1 of 2 no longer")
    assert "every node goes on with 1 of 2 rank(s)" in alert["message"]
    assert "(ranks 2 -> 1)" in alert["message"]
    assert "node 1 has 1 of 2: every node goes on with 1" in _log(nodes[0])
    # node 0's eval runs on its own GPUs, all there, and leaves the run's GPU story as it was
    assert (Path(nodes[0].node_dir) / "eval.txt").read_text() == "as planned\n"
    assert dict(summarize(collect(nodes[0]), None))["GPUs"] == (
        f"node 1 ({socket.gethostname()}) lost GPU 1 of 2; every node goes on with 1 of 2 "
        f"ranks (2 -> 1)"
    )


def test_two_nodes_below_min_gpus_both_stop_and_only_the_node_that_lost_it_says_gpu_lost(
    tmp_path, webhook
):
    nodes = _two_nodes(tmp_path, ["--num_gpus", "2"], min_gpus=2)
    supervisors = [_start(n, {"CLIPFORGE_ALERT_WEBHOOKS": webhook.url()}) for n in nodes]
    assert [s.wait(timeout=120) for s in supervisors] == [1, 1]
    for node in nodes:
        state = _state(node)
        assert state["state"] == "failed" and state["restarts"] == 1
        assert "fewer than --min-gpus=2" in state["reason"]
    sent = [(r.body["rule"], r.body["message"][:6]) for r in webhook.received]
    assert sorted(sent) == [
        ("gpu_lost", "node 1"),
        ("run_failed", "node 0"),
        ("run_failed", "node 1"),
    ]
    assert dict(summarize(collect(nodes[0]), None))["GPUs"].endswith(
        "below --min-gpus=2 per node: stopped"
    )


def test_a_node_waiting_for_its_peers_gpu_count_stops_on_request(tmp_path):
    """Node 0 alone (node 1's supervisor never came): it waits at the agreement, starts nothing,
    and a stop ends it there."""
    (node, _) = _two_nodes(tmp_path, ["--num_gpus", "2"])
    supervisor = _start(node)
    try:
        wait_for(
            lambda: (
                Path(node.train_log).is_file()
                and "waiting for every node's GPU count" in _log(node)
            ),
            what="node 0 waiting for node 1",
            timeout=60,
        )
        stop = subprocess.run(
            [sys.executable, "-m", MODULE, "stop", node.node_dir],
            env=subprocess_env(),
            capture_output=True,
            check=True,
        )
        assert json.loads(stop.stdout)["supervisor_pid"] == supervisor.pid
        assert supervisor.wait(timeout=60) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert _state(node)["state"] == "stopped" and "attempt 1" not in _log(node)


def test_nodes_that_do_not_share_the_run_root_run_as_planned_and_cannot_shrink(tmp_path):
    """Node 1's run root is its own (node 0's files are not there): nothing to meet on, so no
    waiting; all GPUs there, the phase runs as planned; one lost, the node stops saying why."""
    (_, node) = _two_nodes(tmp_path, ["--num_gpus", "2"])
    shutil.rmtree(node.of_node(0).node_dir)
    assert _start(node).wait(timeout=120) == 1  # attempt 1 crashes, losing GPU 1
    state = _state(node)
    assert state["state"] == "failed" and state["restarts"] == 1
    assert "GPU 1 of 2 no longer answers" in state["reason"]
    assert "the run root is not shared between the nodes" in state["reason"]
    assert "waiting for" not in _log(node)
    assert "--num_gpus 2" in _log(node)  # attempt 1, as planned


# -- a real run: 2 nodes x 2 CPU ranks, one "GPU" lost on node b ---------------------------------
# 12 steps, a checkpoint every 4; global batch 32 = micro 8 x accumulation 1 x 4 ranks; on
# 2 nodes x 1 rank, 8 x 2 x 2.
SETS = (
    "train.num_nodes=2",
    "train.ranks_per_node=2",
    "train.micro_batch_size=8",
    "train.log_every_steps=1",
)
MASTER_PORT = 29500  # node a's own network namespace: nothing else listens there


def _latest(checkpoints: Path) -> str | None:
    found = [p.read_text().strip() for p in checkpoints.glob("run-*/latest")]
    return found[0] if found else None


def _stage_args(out: Path, data: Path, params: Path, checkpoints: Path) -> list[str]:
    sets = [arg for item in SETS for arg in ("--set", item)]
    return [*train_argv(out, data, params, checkpoints), *sets]


# Two namespaces x 2 ranks against a 4-rank run (3 minutes): make test-tier3. Tier2 keeps the
# real run that loses a GPU on one host (test_fewer_gpus.py); make test, two real supervisors
# agreeing on the ranks (above).
@pytest.mark.slow
@pytest.mark.tier3
def test_a_gpu_lost_on_one_node_the_run_goes_on_with_one_rank_per_node_and_ends_where_four_end(
    tmp_path, small_data, netns_hosts
):
    """Node b's "GPU 1" stops answering and its rank dies after the checkpoint of step 4: both
    supervisors restart, agree on 1 rank per node, and the run finishes on 2 nodes x 1 rank from
    the checkpoint 4 ranks saved (DeepSpeed's universal checkpoint), same run id, same global
    batch; the loss step by step and the weights end within fp32 round-off of an uninterrupted
    run of 4 ranks (one host: the same world size, rank order and global batch)."""
    params = write_params(tmp_path / "params.yaml")
    reference = tmp_path / "uninterrupted"
    reference.mkdir()
    # The same world on one host: 4 ranks of one node (the run id differs: num_nodes is a param).
    one_host = [
        arg if arg != "train.num_nodes=2" else "train.num_nodes=1"
        for arg in _stage_args(reference, small_data, params, reference / "checkpoints")
    ]
    one_host = [a if a != "train.ranks_per_node=2" else "train.ranks_per_node=4" for a in one_host]
    done = subprocess.run(
        [sys.executable, "-m", "clipforge.train", *one_host],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    root = tmp_path / "root"
    nodes = [NodeLayout(root=str(root), launch_id="run", node_rank=r) for r in (0, 1)]
    a, b = netns_hosts.hosts
    record = run_record(
        launch_id="run",
        num_nodes=2,
        gpus_per_node=2,
        hosts=(a.address, b.address),
        master=f"{a.address}:{MASTER_PORT}",
    )
    checkpoints = Path(nodes[0].shared_checkpoints)
    checkpoints.mkdir(parents=True)
    Path(nodes[0].record).write_text(record.to_json())
    Path(nodes[0].hostfile).write_text(hostfile_text([a.address, b.address], 2))
    release = root / "release"
    policy = RestartPolicy(
        max_restarts=2, backoff_seconds=0.1, backoff_max_seconds=0.2, stop_timeout_seconds=60
    )
    for node in nodes:
        out = Path(node.node_dir) / "out"
        out.mkdir(parents=True)
        argv = multinode_train_argv(
            sys.executable,
            node_rank=node.node_rank,
            num_nodes=2,
            ranks_per_node=2,
            master_addr=a.address,
            master_port=MASTER_PORT,
            hostfile=node.hostfile,
            overrides=(),
            data_dir=str(small_data),
            checkpoints_dir=str(checkpoints),
        )
        # the stage's own arguments: the reduced params, outputs in this node's folder
        argv = argv[: argv.index("clipforge.train") + 1] + _stage_args(
            out, small_data, params, checkpoints
        )
        phase = Phase(
            name="train",
            argv=argv,
            cwd=str(out),
            # step 6 waits for `release`: node b's rank dies after the checkpoint of step 4
            env={"CLIPFORGE_FAULTS": f"wait@6={release}", "GLOO_SOCKET_IFNAME": "eth0"},
            spans_nodes=True,
        )
        Path(node.plan).write_text(PhasePlan(phases=[phase], policy=policy).to_json())
        (Path(node.node_dir) / FAULT_FILE).write_text("0\n1\n")

    webhook = made_in_namespace(netns_hosts.laptop, lambda: WebhookServer(LAPTOP_ADDRESS))
    webhook.start()
    env = {"CLIPFORGE_ALERT_WEBHOOKS": webhook.url()}
    supervisors = [
        _start(node, env, prefix=("ip", "netns", "exec", host.netns))
        for node, host in zip(nodes, (a, b))
    ]
    try:
        wait_for(
            lambda: _latest(checkpoints) == "step-00000004",
            what="the checkpoint of step 4",
            timeout=1800,
        )
        wait_for(
            lambda: len(read_progress(nodes[1].progress_dir)) == 2,
            what="both ranks' heartbeats on node b",
            timeout=600,
        )
        (Path(nodes[1].node_dir) / FAULT_FILE).write_text("0\n")  # GPU 1 no longer answers...
        (rank,) = [p for p in read_progress(nodes[1].progress_dir) if p.rank == 3]
        os.kill(rank.pid, signal.SIGKILL)  # ...and its rank (global rank 3) is gone with it
        release.touch()
        assert [s.wait(timeout=2400) for s in supervisors] == [0, 0]
    finally:
        for supervisor in supervisors:
            if supervisor.poll() is None:
                supervisor.kill()
        webhook.stop()

    for node in nodes:
        state = _state(node)
        assert state["state"] == "finished" and state["restarts"] == 1, _log(node)[-3000:]
        assert (state["gpus"]["ranks"], state["gpus"]["ranks_before"]) == (1, 2)
    (run_dir,) = checkpoints.iterdir()  # one run id across the world-size change
    log = _log(nodes[0])
    assert "loading it through DeepSpeed's universal checkpoint" in log
    assert f"resuming {run_dir.name} at step 4/12" in log
    assert "batch 32 = 8 micro x 2 accum x 2 ranks" in log
    (alert,) = [r.body for r in webhook.received if r.body["rule"] == "gpu_lost"]
    assert alert["message"].startswith("node 1 (") and "GPU 1 of 2 no longer" in alert["message"]
    assert "(ranks 2 -> 1)" in alert["message"]
    assert dict(summarize(collect(nodes[0]), None))["GPUs"].endswith(
        "lost GPU 1 of 2; every node goes on with 1 of 2 ranks (2 -> 1)"
    )

    # Steps 1-4: the same four ranks in the same order, bit for bit (gloo sums the same way
    # across two hosts as on one); then the same maths on two (measured: weights 1.4e-7 apart).
    out = Path(nodes[0].node_dir) / "out"
    assert_same_run(reference, out, steps=12, exact_through=4)
