"""The two pods of a `fab train --kubernetes --nodes 2` JobSet, executed here on two hosts of
their own (the network namespaces of tests/support/netns.py): each pod's rendered command and
environment run in its host's namespace, with the JOB_COMPLETION_INDEX its Job would give it,
the pod's host name, and an /etc/hosts as the cluster gives a pod (its own name resolves to its
address, the JobSet's headless Service resolves `<name>-node-0-<i>.<name>`). The checkpoints
"volume" is one directory both hosts see, as the pods share the checkpoints PVC.

Both pods die (every process killed, as when a node is lost and the JobSet recreates every pod)
once the run store holds a checkpoint; the same two pods started again, pod 1 first while pod
0's name does not resolve yet, resume the run, which ends with the loss and weights of one host
running two ranks, bit for bit (test_multinode.py shows that equals the SSH path's two-node
run)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clipforge.launcher import kubernetes_objects as k8s_objects
from tests.launcher import test_multinode
from tests.support.hostprocs import processes_under
from tests.support.k8spod import Pod, render_cpu_run, stored_step
from tests.support.wait import still_running, wait_for

# Two namespace hosts, a JobSet's pods replaced (three minutes): make test-tier3. Tier2 keeps a
# replacement pod resuming a run (test_kubernetes_pod.py) and two real nodes over SSH
# (test_multinode.py); make test, the JobSet's objects (test_kubernetes.py).
pytestmark = [pytest.mark.slow, pytest.mark.tier3]
MODEL = test_multinode.MODEL
# The reference: one host, two ranks, the same params (test_multinode.py's module fixture).
one_host_reference = test_multinode.one_host_reference
NODES = 2
STORED_STEP = 4  # of RUN_SETS' 8, saved every 2: in the store when the first pods die
WAIT_STEP = 5  # the first pods wait there (CLIPFORGE_FAULTS wait@) until the test lets them go
# What torch's c10d logs each time the master's name does not resolve (it retries until its
# timeout, the train stage's collective timeout).
LOOKUP_FAILED = "cannot be retrieved (gai error"
# A pod's /etc/hosts and host name, as in the pod: `ip netns exec` has given the namespace's
# /etc, this mounts the pod's hosts file over it in a mount namespace of its own.
IN_POD = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


def _hosts_file(net, rank: int, launch_id: str, published: range) -> str:
    """Pod `rank`'s /etc/hosts: the kubelet's (its own name at its address), then the headless
    Service's names (the cluster DNS) of the pods `published`, which are those Ready."""
    fqdn = k8s_objects.jobset_host(launch_id, rank)
    lines = ["127.0.0.1 localhost", f"{net.hosts[rank].address} {fqdn}.ns.svc.cluster.local"]
    lines[-1] += " " + fqdn.split(".", 1)[0]
    lines += [f"{net.hosts[r].address} {k8s_objects.jobset_host(launch_id, r)}" for r in published]
    return "\n".join(lines) + "\n"


def _pod_prefix(net, rank: int, launch_id: str, hosts: Path) -> tuple[str, ...]:
    """What puts pod `rank` on host `rank`: its network namespace, the JobSet pod's host name
    (`<name>-node-0-<rank>`) and `hosts` as its /etc/hosts (bound, so rewriting the file in
    place publishes a name to the running pod)."""
    hostname = k8s_objects.jobset_host(launch_id, rank).split(".", 1)[0]
    return (
        "ip", "netns", "exec", net.hosts[rank].netns, "unshare", "--mount", "--uts",
        "sh", "-c", IN_POD, "in-pod", str(hosts), hostname,
    )  # fmt: skip


@pytest.fixture(scope="module")
def recreated_jobset(netns_hosts, project, tmp_path_factory):
    base = tmp_path_factory.mktemp("k8s-jobset")
    run = render_cpu_run(project, base, NODES, WAIT_STEP)
    launch_id, objects, store, go = run.launch_id, run.objects, run.store, run.go
    assert objects[-1]["kind"] == "JobSet"
    every = range(NODES)
    pods, prefixes, hosts = [], [], []
    for rank in every:
        workdir = base / f"pod-{rank}"
        workdir.mkdir()
        pods.append(
            Pod(objects, base / "run-files", workdir, env={"JOB_COMPLETION_INDEX": str(rank)})
        )
        hosts.append(workdir / "hosts")
        hosts[rank].write_text(_hosts_file(netns_hosts, rank, launch_id, every))
        prefixes.append(_pod_prefix(netns_hosts, rank, launch_id, hosts[rank]))

    def outputs(name: str) -> str:
        return "\n".join(f"-- pod {r}:\n{p.output(name)}" for r, p in enumerate(pods))

    first = [pod.start("first", prefix) for pod, prefix in zip(pods, prefixes, strict=True)]
    try:
        wait_for(
            lambda: stored_step(store) == f"step-{STORED_STEP:08d}",
            what="a checkpoint in the run store",
            timeout=1800,
            check=lambda: [still_running(p, lambda: outputs("first"))() for p in first],
        )
    finally:  # the JobSet recreates every pod: all their processes killed, nothing said to them
        for pid in processes_under(run.checkpoints):
            os.kill(pid, signal.SIGKILL)
        for process in first:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    go.touch()  # the fault is the first pods': their replacements go past that step
    # The recreated pod 1 starts first, while pod 0's name does not resolve yet (a JobSet
    # publishes only Ready pods, and pod 0 may wait for its node or image); once its train
    # stage has failed to look the master up, pod 0 becomes Ready, its name published.
    run_dir = run.checkpoints / "clipforge-runs" / "runs" / launch_id
    log_1 = run_dir / "node-1" / "train.log"
    seen = log_1.stat().st_size  # the lost pod's part of the log
    hosts[1].write_text(_hosts_file(netns_hosts, 1, launch_id, range(1, NODES)))
    pod_1 = pods[1].start("second", prefixes[1])
    wait_for(
        lambda: LOOKUP_FAILED in log_1.read_bytes()[seen:].decode(errors="replace"),
        what="pod 1 failing to look up pod 0's name",
        timeout=900,
        check=still_running(pod_1, lambda: pods[1].output("second")),
    )
    hosts[1].write_text(_hosts_file(netns_hosts, 1, launch_id, every))
    second = [pods[0].start("second", prefixes[0]), pod_1]
    codes = [process.wait(timeout=1800) for process in second]
    return {
        "codes": codes,
        "run_dir": run_dir,
        "outputs": outputs,
        "launch_id": launch_id,
        "pod_1_log": log_1.read_bytes()[seen:].decode(errors="replace"),
    }


def test_recreated_jobset_pods_resume_to_the_weights_of_one_host_with_two_ranks(
    recreated_jobset, one_host_reference
):
    """Both recreated pods' supervisors finish the run from the checkpoint of the lost ones;
    the loss and every exported weight equal one host's with two ranks, bit for bit."""
    run_dir = recreated_jobset["run_dir"]
    assert recreated_jobset["codes"] == [0, 0], recreated_jobset["outputs"]("second")
    for rank in range(NODES):
        node = run_dir / f"node-{rank}"
        state = json.loads((node / "state.json").read_text())
        assert state["state"] == "finished", (node / "train.log").read_text()[-3000:]
    code = run_dir / "node-0" / "code"
    info = json.loads((code / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == STORED_STEP and info["steps"] == 8
    summary = json.loads((code / "metrics" / "train.json").read_text())
    reference = json.loads((one_host_reference / "metrics" / "train.json").read_text())
    assert summary["loss"] == reference["loss"]
    pods, one_host = load_file(str(code / MODEL)), load_file(str(one_host_reference / MODEL))
    assert pods.keys() == one_host.keys()
    for name in one_host:
        assert torch.equal(pods[name], one_host[name]), name


def test_the_pods_met_at_pod_0_s_dns_name_and_hold_both_ranks_shards(recreated_jobset):
    """The run record names pod 0's JobSet host name as the master, and the shared checkpoints
    on the volume hold both ranks' optimizer shards."""
    run_dir, launch_id = recreated_jobset["run_dir"], recreated_jobset["launch_id"]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["master"].startswith(k8s_objects.master_address(launch_id) + ":")
    latest = next((run_dir / "checkpoints").glob("run-*/latest"))
    assert len(list((latest.parent / latest.read_text().strip()).glob("*optim_states.pt"))) == 2


def test_a_pod_started_before_pod_0_s_name_resolves_waits_for_it(recreated_jobset):
    """The recreated pod 1 looked pod 0's name up before it was published (the fixture waited
    for that) and its first train attempt went on to finish: no restart spent on the wait."""
    run_dir = recreated_jobset["run_dir"]
    assert LOOKUP_FAILED in recreated_jobset["pod_1_log"]
    assert recreated_jobset["pod_1_log"].count("phase train attempt") == 1
    assert json.loads((run_dir / "node-1" / "state.json").read_text())["restarts"] == 0
