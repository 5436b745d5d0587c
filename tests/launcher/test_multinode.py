"""`fab -H a,b train --nodes 2`: two hosts with their own network stacks, really run.

The hosts are network namespaces with their own sshd and address (tests/support/netns.py), in
which the machine's hostname resolves to 127.0.1.1, as on a fresh Debian box: torch's gloo,
left to itself, would advertise that loopback to the peer. The run root is shared storage (one
directory both see), as real nodes share the checkpoints volume; one CPU rank per node, so the
process group spans the two hosts over their veth link.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import git, subprocess_env
from tests.launcher.conftest import RUN_SETS, host_train_args, make_fab, set_args, wait_for_end
from tests.support.netns import (
    LAPTOP_ADDRESS,
    NetnsUnavailable,
    made_in_namespace,
    test_network,
)
from tests.support.sshd import keygen
from tests.support.wait import wait_for
from tests.support.webhooks import WebhookServer

pytestmark = pytest.mark.slow

MASTER_PORT = "29500"  # node a's own network namespace: nothing else listens there
MODEL = "models/clip/open_clip_model.safetensors"


class TwoNodeRun:
    def __init__(self, net, fab, root: Path, launch: subprocess.CompletedProcess):
        assert launch.returncode == 0, launch.stdout + launch.stderr
        self.net, self.fab, self.root, self.launch = net, fab, root, launch
        self.launch_id = next(
            line.split()[2]
            for line in launch.stdout.splitlines()
            if line.startswith("started run ")
        )
        self.run_dir = root / "runs" / self.launch_id
        self.nodes = [self.run_dir / "node-0", self.run_dir / "node-1"]

    def fab_all(self, *args: str) -> subprocess.CompletedProcess:
        return self.fab(*args, hosts=self.net.host_list(), key=self.net.client_key, timeout=600)

    def state(self, rank: int) -> dict:
        return json.loads((self.nodes[rank] / "state.json").read_text())

    def log(self, rank: int) -> str:
        return (self.nodes[rank] / "train.log").read_text()

    def ends(self) -> list[dict]:
        return [wait_for_end(node, timeout=1800) for node in self.nodes]

    def latest_step(self) -> str | None:
        latest = list((self.run_dir / "checkpoints").glob("run-*/latest"))
        return latest[0].read_text().strip() if latest else None


def net_fab(net, project: Path, base: Path, servers=None):
    """`fab` in the laptop's namespace, knowing the hosts' keys (or only `servers`')."""
    servers = servers if servers is not None else [h.sshd for h in net.hosts]
    return make_fab(project, base / "home", base / "remote", *servers, prefix=net.on_laptop)


def train_two_nodes(net, fab, *extra: str, env: dict | None = None):
    return fab(
        *host_train_args(),
        "--nodes",
        "2",
        "--master-port",
        MASTER_PORT,
        *set_args(RUN_SETS),
        *extra,
        hosts=net.host_list(),
        key=net.client_key,
        env=env,
        timeout=600,
    )


def start_two_node_run(net, project: Path, base: Path, *extra: str, env: dict | None = None):
    fab = net_fab(net, project, base)
    return TwoNodeRun(net, fab, base / "remote", train_two_nodes(net, fab, *extra, env=env))


@pytest.fixture(scope="module")
def two_node_run(netns_hosts, project, tmp_path_factory):
    run = start_two_node_run(netns_hosts, project, tmp_path_factory.mktemp("two-nodes"))
    run.final = run.ends()
    return run


@pytest.fixture(scope="module")
def one_host_reference(project, tmp_path_factory) -> Path:
    """The same params on one host with two ranks (world size and global batch as the two
    nodes'): the data stage, then the train stage under DeepSpeed's launcher, in a workspace."""
    work = tmp_path_factory.mktemp("one-host")
    (work / "params.yaml").write_bytes((project / "params.yaml").read_bytes())
    sets = set_args([*RUN_SETS, "train.device=cpu", "train.ranks_per_node=2", "train.num_nodes=1"])
    for stage in ("clipforge.data", "clipforge.train"):
        result = subprocess.run(
            [sys.executable, "-m", stage, *sets],
            cwd=work,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return work


@pytest.mark.tier2
def test_two_hosts_train_like_one_host_with_two_ranks(two_node_run, one_host_reference):
    """Both nodes finish; the final loss and every weight equal those of one host running two
    ranks with the same global batch, bit for bit (gloo sums two tensors the same way)."""
    for rank, state in enumerate(two_node_run.final):
        assert state["state"] == "finished", two_node_run.log(rank)[-3000:]
    code = two_node_run.nodes[0] / "code"
    summary = json.loads((code / "metrics" / "train.json").read_text())
    reference = json.loads((one_host_reference / "metrics" / "train.json").read_text())
    steps = [
        json.loads((d / "metrics" / "train.info.json").read_text())["steps"]
        for d in (code, one_host_reference)
    ]
    assert steps == [8, 8]
    assert summary["loss"] == reference["loss"]
    two_hosts, one_host = load_file(str(code / MODEL)), load_file(str(one_host_reference / MODEL))
    assert two_hosts.keys() == one_host.keys()
    for name in one_host:
        assert torch.equal(two_hosts[name], one_host[name]), name


@pytest.mark.tier2
def test_each_node_talks_on_its_route_to_the_master_and_the_run_records_it(two_node_run):
    """The hostname resolves to the loopback on the hosts, yet the ranks met: each node got the
    interface of its route to node a (GLOO_SOCKET_IFNAME), recorded in run.json."""
    a = two_node_run.net.hosts[0]
    resolved = two_node_run.net.run(a.netns, "getent", "hosts", os.uname().nodename).stdout
    assert resolved.startswith("127.0.1.1")
    record = json.loads((two_node_run.run_dir / "run.json").read_text())
    assert record["master"] == f"{a.address}:{MASTER_PORT}"
    assert [i["interface"] for i in record["socket_interfaces"]] == ["eth0", "eth0"]
    assert {i["chosen_by"] for i in record["socket_interfaces"]} == {"route to the master"}
    plan = json.loads((two_node_run.nodes[1] / "plan.json").read_text())
    train = next(p for p in plan["phases"] if p["name"] == "train")
    assert train["env"]["GLOO_SOCKET_IFNAME"] == "eth0"


@pytest.mark.tier2
def test_checkpoints_hold_both_ranks_shards_on_the_shared_storage(two_node_run):
    latest = next((two_node_run.run_dir / "checkpoints").glob("run-*/latest"))
    step_dir = latest.parent / latest.read_text().strip()
    assert len(list(step_dir.glob("*optim_states.pt"))) == 2


@pytest.mark.tier2
def test_status_and_logs_cover_both_nodes(two_node_run):
    """`fab status` and `fab logs` with both hosts: every node's state and output."""
    status = two_node_run.fab_all("status")
    assert status.returncode == 0, status.stderr
    assert "2 nodes x CPU" in status.stdout and "node 1: finished" in status.stdout
    logs = two_node_run.fab_all("logs", "--lines", "400")
    assert logs.returncode == 0, logs.stderr
    for rank, host in enumerate(two_node_run.net.hosts):
        assert f"node {rank} ({host.sshd.address})" in logs.stdout
    assert logs.stdout.count("all phases finished") == 2


# Both nodes restarted, stopped and resumed (about 5 minutes beside the other tiers): make
# test-tier3. Tier2 keeps a killed rank restarted, a stop and a resume to the same result on one
# host (test_supervision.py), a node cut off (below) and two nodes training as one (above).
@pytest.mark.tier3
def test_killed_ranks_on_node_b_restart_both_nodes_then_stop_and_resume(
    netns_hosts, project, tmp_path_factory, two_node_run
):
    """SIGKILL to node b's training processes during a step: both supervisors restart and the
    run resumes; `fab stop` then checkpoints both nodes; a node whose checkout moved to another
    commit is refused; `fab train --resume` finishes it with the uninterrupted run's weights."""
    run = start_two_node_run(
        netns_hosts,
        project,
        tmp_path_factory.mktemp("killed"),
        env={"CLIPFORGE_FAULTS": "stall@5=15,hold@7"},
    )
    # Step 5 sleeps 15 s on both ranks, right after the checkpoint of step 4: kill then.
    wait_until(lambda: run.latest_step() == "step-00000004", run, "checkpoint of step 4")
    os.killpg(run.state(1)["child_pid"], signal.SIGKILL)
    wait_until(lambda: all(run.state(r)["restarts"] >= 1 for r in (0, 1)), run, "both restarted")
    # Both resumed, passed step 5 again and hold at step 7 until a stop.
    wait_until(lambda: run.latest_step() == "step-00000006", run, "checkpoint of step 6")
    stop = run.fab_all("stop")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert [run.state(r)["state"] for r in (0, 1)] == ["stopped", "stopped"]
    assert run.latest_step() == "step-00000007"

    node_b = run.nodes[1] / "code"
    git(node_b, "-c", "user.name=x", "-c", "user.email=x@x", "commit", "--allow-empty", "-qm", "x")
    refused = run.fab_all("train", "--resume", run.launch_id)
    assert refused.returncode == 1 and "nothing was started" in refused.stderr
    assert "node 1" in refused.stderr and "commit" in refused.stderr
    git(node_b, "reset", "--quiet", "--hard", "HEAD~1")

    resumed = run.fab_all("train", "--resume", run.launch_id)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [s["state"] for s in run.ends()] == ["finished", "finished"]
    assert run.latest_step() == "step-00000008"
    final = load_file(str(run.nodes[0] / "code" / MODEL))
    reference = load_file(str(two_node_run.nodes[0] / "code" / MODEL))
    for name in reference:
        assert torch.equal(final[name], reference[name]), name


@pytest.mark.tier2
def test_a_node_cut_off_mid_run_fails_with_a_clear_line_and_an_alert(
    netns_hosts, project, tmp_path_factory
):
    """Node b's link goes down during a step: the collective gives up after the stall timeout,
    the restarts meet the same rendezvous error, and the supervisors give up saying so, with a
    run_failed alert (node a's reaches the webhook; node b has no network left)."""
    webhook = made_in_namespace(netns_hosts.laptop, lambda: WebhookServer(LAPTOP_ADDRESS))
    webhook.start()
    a, b = netns_hosts.hosts
    try:
        run = start_two_node_run(
            netns_hosts,
            project,
            tmp_path_factory.mktemp("cut-off"),
            "--set",
            "alerts.stall_timeout_seconds=20",
            "--max-restarts",
            "5",
            env={"CLIPFORGE_FAULTS": "stall@3=10", "CLIPFORGE_ALERT_WEBHOOKS": webhook.url()},
        )
        wait_until(lambda: run.latest_step() == "step-00000002", run, "checkpoint of step 2")
        netns_hosts.set_link(b, up=False)
        ends = run.ends()
    finally:
        netns_hosts.set_link(b, up=True)
    assert [e["state"] for e in ends] == ["failed", "failed"]
    assert "the same rendezvous error twice in a row" in ends[0]["reason"]
    assert ends[0]["restarts"] < 5  # gave up on the repeat, not by using every restart
    alerts = [json.dumps(r.body) for r in webhook.received]
    webhook.stop()
    assert any("run_failed" in text and "node 0" in text for text in alerts), alerts


def test_a_node_without_a_route_to_the_master_is_refused_before_anything_starts(
    netns_hosts, project, tmp_path_factory
):
    """Node b answers SSH but has no route to node a: the network row says so, nothing starts."""
    a, b = netns_hosts.hosts
    netns_hosts.run(b.netns, "ip", "route", "add", "blackhole", f"{a.address}/32")
    base = tmp_path_factory.mktemp("no-route")
    try:
        result = train_two_nodes(netns_hosts, net_fab(netns_hosts, project, base))
    finally:
        netns_hosts.run(b.netns, "ip", "route", "del", "blackhole", f"{a.address}/32")
    assert result.returncode == 1
    assert f"no route to {a.address}" in result.stdout and "nothing was started" in result.stderr
    assert not (base / "remote" / "runs").exists()


def test_an_interface_setting_that_a_node_lacks_is_refused_before_anything_starts(
    netns_hosts, project, tmp_path_factory
):
    """clipforge.socket_ifname names an interface the nodes do not have: refused, saying which
    interfaces they do have."""
    base = tmp_path_factory.mktemp("no-ib0")
    fab = net_fab(netns_hosts, project, base)
    result = train_two_nodes(netns_hosts, fab, env={"FABRIC_CLIPFORGE_SOCKET_IFNAME": "ib0"})
    assert result.returncode == 1 and "nothing was started" in result.stderr
    assert "no interface ib0 with an IPv4 address here (found: eth0, lo)" in result.stderr
    assert not (base / "remote" / "runs").exists()


def test_a_wrong_host_key_on_node_b_only_refuses_the_launch(netns_hosts, project, tmp_path_factory):
    """known_hosts holds another key for node b: refused as CHANGED, nothing started on a."""
    base = tmp_path_factory.mktemp("wrong-key")
    a, b = netns_hosts.hosts
    other = keygen(base / "other_host_key")
    fab = net_fab(netns_hosts, project, base, servers=[a.sshd])
    kind, blob = Path(f"{other}.pub").read_text().split()[:2]
    with open(base / "home" / ".ssh" / "known_hosts", "a") as known:
        known.write(f"{b.address} {kind} {blob}\n")
    result = train_two_nodes(netns_hosts, fab)
    assert result.returncode == 1 and "host key CHANGED" in result.stderr
    assert b.address in result.stderr
    assert not (base / "remote" / "runs").exists()


@pytest.fixture(scope="module")
def public_network(tmp_path_factory):
    """Hosts a and b on their private network (eth0), a on a public one too (wan0, its first
    interface), with an `outside` namespace on that public network (tests/support/netns.py)."""
    stack = contextlib.ExitStack()
    try:
        net = stack.enter_context(
            test_network(tmp_path_factory.mktemp("public-net"), public=("a",))
        )
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    with stack:
        yield net


CONNECT = """import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""


def connect_from(net, netns: str, address: str, port: str) -> str:
    return net.run(netns, sys.executable, "-c", CONNECT, address, port).stdout.strip()


def listening_addresses(net, netns: str) -> list[str]:
    """host:port of every listening TCP socket in the namespace."""
    rows = net.run(netns, "ss", "-ltnH").stdout.splitlines()
    return [row.split()[3] for row in rows if row.strip()]


def test_a_public_master_address_is_refused_unless_allowed(
    public_network, project, tmp_path_factory
):
    """clipforge.socket_ifname names node a's public interface: the launch is refused in one line
    naming the address and both ways out, before anything starts."""
    net = public_network
    base = tmp_path_factory.mktemp("public-master")
    result = train_two_nodes(
        net, net_fab(net, project, base), env={"FABRIC_CLIPFORGE_SOCKET_IFNAME": "wan0"}
    )
    assert result.returncode == 1, result.stdout + result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert f"the public address {net.hosts[0].public_address}" in line
    assert "clipforge.socket_ifname" in line and "--allow-public-master" in line
    assert not (base / "remote" / "runs").exists()


@pytest.mark.tier2  # make test keeps the refusal above and test_rendezvous_binding.py's binds
def test_while_two_nodes_train_their_rendezvous_answers_on_the_private_network_alone(
    public_network, project, tmp_path_factory
):
    """Node a lists its public address first, as rented boxes do: the master is its private
    one. While the nodes train (held at step 3 until stopped), the outside namespace's connection
    to a's public address on the master port is refused and node b's to the private one
    accepted; nothing on node a listens on a public or wildcard address."""
    net = public_network
    a, b = net.hosts
    run = start_two_node_run(
        net, project, tmp_path_factory.mktemp("private-master"), env={"CLIPFORGE_FAULTS": "hold@3"}
    )
    try:
        wait_until(lambda: " step 2/" in run.log(0), run, "step 2 trained")
        record = json.loads((run.run_dir / "run.json").read_text())
        assert record["master"] == f"{a.address}:{MASTER_PORT}"
        assert connect_from(net, net.outside, a.public_address, MASTER_PORT) == (
            "ConnectionRefusedError"
        )
        assert connect_from(net, b.netns, a.address, MASTER_PORT) == "connected"
        listening = listening_addresses(net, a.netns)
        assert f"{a.address}:{MASTER_PORT}" in listening
        wide = [x for x in listening if x.startswith(("0.0.0.0:", "*:", "[::]:", a.public_address))]
        assert not wide, listening
    finally:
        stop = run.fab_all("stop")
    assert stop.returncode == 0, stop.stdout + stop.stderr


def wait_until(predicate, run: TwoNodeRun, what: str, timeout: float = 900) -> None:
    """Poll the shared storage until predicate() holds (a safety limit, not a speed test)."""

    def no_node_failed() -> None:
        states = [
            run.state(r).get("state") for r in (0, 1) if (run.nodes[r] / "state.json").exists()
        ]
        if "failed" in states:
            raise AssertionError(f"{what}: a node failed first; {states}\n{run.log(0)[-3000:]}")

    wait_for(predicate, what=what, timeout=timeout, check=no_node_failed)
