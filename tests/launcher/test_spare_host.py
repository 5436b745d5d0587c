"""A box dies, the run goes on: `fab -H a train --spare b` starts a recovery controller on b
(clipforge.launcher.controller) that probes a. Once the run store holds a checkpoint, host a
dies: every process of its network namespace killed, its sshd included, its run directory
lost. Nobody types a command: the controller decides a is gone (k missed probes over N
seconds), moves the run to b from the run store, and the run finishes there with the weights
of the uninterrupted run (the smoke run's training; same world size: bit for bit). `fab status`
shows the move, from the new host and from the store.

Two machines of their own (tests/support/netns.py), `fab` on a third, the store (moto's S3) on
the laptop's network. Host a's sshd is started again at the end, for the session's other tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal

import pytest

from tests.launcher.conftest import RUN_SETS, host_train_args, make_fab, set_args, wait_for_end
from tests.launcher.test_moved_run import STORED_STEP, _client
from tests.support.netns import LAPTOP_ADDRESS, SSH_PORT, made_in_namespace
from tests.support.s3store import S3Server
from tests.support.same_run import exported_weights
from tests.support.sshd import start_sshd
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.tier2]
HELD_STEP = 5  # of the 8 of RUN_SETS: host a holds there until it dies
# The rule, made short for the test (defaults: a probe every 30 s, 4 misses over 120 s).
RULE_SETTINGS = {
    "FABRIC_CLIPFORGE_PROBE_EVERY_SECONDS": "0.5",
    "FABRIC_CLIPFORGE_GONE_AFTER_MISSES": "3",
    "FABRIC_CLIPFORGE_GONE_AFTER_SECONDS": "2",
}


def _rows(output: str) -> dict[str, str]:
    return dict(re.findall(r"^  (\w[\w ]*?)\s{2,}(.+)$", output, re.MULTILINE))


def _kill_namespace(net, host) -> None:
    """Every process of the host's network namespace: its sshd, the supervisor and the ranks
    it started (whatever a's sshd started lives there)."""
    for pid in net.pids(host.netns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _rows_with(fab, launch_id: str, remote: str, row: str, holding: str = ""):
    """`fab status --run ID` (--launch's alias) from the store as rows, once its `row` holds
    `holding`; else None."""
    rows = _rows(fab("status", "--run", launch_id, "--store", remote).stdout)
    return rows if row in rows and holding in rows[row] else None


@pytest.fixture(scope="module")
def spared_run(netns_hosts, project, tmp_path_factory):
    base = tmp_path_factory.mktemp("spare-host")
    a, b = netns_hosts.hosts
    server = made_in_namespace(netns_hosts.laptop, lambda: S3Server(LAPTOP_ADDRESS).start())
    # The hosts share this machine's disk: one run root path, which a's death removes before b
    # takes the run (as a new box's empty disk).
    root = base / "run-root"
    try:
        bucket = "runs-with-a-spare"
        made_in_namespace(netns_hosts.laptop, lambda: _client(server).create_bucket(Bucket=bucket))
        remote = f"s3://{bucket}/runs"
        fab = make_fab(project, base / "home", root, a.sshd, b.sshd, prefix=netns_hosts.on_laptop)
        fab.env.update({**server.env, **RULE_SETTINGS})
        started = fab(
            *host_train_args(), *set_args([*RUN_SETS, f"storage.remote={remote}"]),
            "--spare", b.ssh_target,
            hosts=a.ssh_target, key=a.sshd.client_key,
            env={"CLIPFORGE_FAULTS": f"hold@{HELD_STEP}"},
        )  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        run_id = re.search(r"^started run (\S+)", started.stdout, re.MULTILINE).group(1)

        wait_for(
            lambda: _rows_with(fab, run_id, remote, "run store", f"step {STORED_STEP},"),
            what="checkpoint stored",
            timeout=600,
            interval=1,
        )
        _kill_namespace(netns_hosts, a)
        shutil.rmtree(root)
        moved = wait_for(
            lambda: _rows_with(fab, run_id, remote, "moved"),
            what="the controller moving the run",
            timeout=600,
            interval=1,
        )
        node = root / "runs" / run_id / "node-0"
        final = wait_for_end(node)
        ended = wait_for(
            lambda: _rows_with(fab, run_id, remote, "recovery", "finished ("),
            what="the controller ending",
            timeout=120,
            interval=1,
        )
        on_b = fab("status", hosts=b.ssh_target, key=b.sshd.client_key)
    finally:
        server.stop()
        if a.sshd.process.poll() is not None:  # host a again, for the session's other tests
            a.sshd = start_sshd(
                base / "sshd-a-again", listen=a.address, port=SSH_PORT, netns=a.netns,
                client_key=a.sshd.client_key,
            )  # fmt: skip
    return dict(
        a=a, b=b, run_id=run_id, started=started, moved=moved, ended=ended, on_b=on_b,
        node=node, final=final,
    )  # fmt: skip


def test_a_run_whose_host_dies_finishes_on_the_spare_with_the_same_weights(spared_run, smoke_run):
    """No command typed after `fab train`: the run resumes on b from the store's step-4
    checkpoint and ends with the exported weights of the uninterrupted run, bit for bit."""
    assert "recovery: the controller on" in spared_run["started"].stdout
    node = spared_run["node"]
    assert spared_run["final"]["state"] == "finished", (node / "train.log").read_text()[-3000:]
    info = json.loads((node / "code" / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == STORED_STEP
    assert exported_weights(node / "code" / "models" / "clip") == exported_weights(
        smoke_run.code / "models" / "clip"
    )
    record = json.loads((node.parent / "run.json").read_text())
    assert record["host"] == spared_run["b"].ssh_target


def test_status_shows_the_move_from_host_to_spare_when_and_why(spared_run):
    """`fab status`, from the store and on the new host: `moved  a -> b at <time>: a gone: N
    probes missed in a row over S s (the last: ssh: ...)`, and the controller done."""
    a, b = spared_run["a"].ssh_target, spared_run["b"].ssh_target
    for rows in (spared_run["ended"], _rows(spared_run["on_b"].stdout)):
        assert re.match(
            rf"{re.escape(a)} -> {re.escape(b)} at \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC: "
            rf"{re.escape(a)} gone: \d+ probes missed in a row over \d+ s \(the last: ssh: ",
            rows["moved"],
        ), rows
        assert rows["recovery"].startswith("finished (controller on " + b), rows
        assert "moves 1 of 2" in rows["recovery"], rows
