"""The process group listens where it must, and nowhere else: rank 0's TCPStore on MASTER_ADDR
alone (torch's own listens on every interface), gloo on the loopback interface for a world on
one machine, the preflight's test listener on the master address. "Elsewhere" is 127.0.0.2: an
address of this machine (every 127/8 address is) on which a socket bound to 127.0.0.1 does not
answer, while one bound to every interface does. The two-node run in network namespaces, with an
outside namespace on a public network, is test_multinode.py's (tier2)."""

from __future__ import annotations

import datetime
import json
import socket
import threading

import pytest

from clipforge.launcher.host import netprobe
from clipforge.train.dist import rendezvous_store
from tests.conftest import subprocess_env
from tests.support.sshd import free_port
from tests.support.wait import wait_for
from tests.support.workers import ranks_of

ELSEWHERE = "127.0.0.2"


def _answers(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


def test_a_socket_on_every_interface_answers_elsewhere_here():
    """The premise of these tests: on this machine 127.0.0.2 reaches a wildcard listener."""
    with socket.create_server(("", 0)) as server:
        assert _answers(ELSEWHERE, server.getsockname()[1])


def test_rank_0s_store_listens_on_the_master_address_alone():
    """rendezvous_store on rank 0: a client reaches it at MASTER_ADDR, not at another address of
    the same machine."""
    store = rendezvous_store("127.0.0.1", 0, 0, 1, datetime.timedelta(seconds=30))
    store.set("k", "v")
    assert _answers("127.0.0.1", store.port)
    assert not _answers(ELSEWHERE, store.port)


def test_a_master_address_that_is_not_this_hosts_is_one_line():
    """MASTER_ADDR naming an address this host does not have (asked again until the store's
    timeout, as a pod's own name may still resolve to its predecessor's): a user error naming
    it."""
    from clipforge.errors import UserError

    with pytest.raises(UserError, match="MASTER_ADDR 192.0.2.77 port .* an address of this host"):
        rendezvous_store("192.0.2.77", free_port(), 0, 2, datetime.timedelta(seconds=1))


@pytest.mark.slow
def test_two_ranks_on_one_machine_listen_on_loopback_alone():
    """Two CPU ranks joined as the train stage joins them (MASTER_ADDR 127.0.0.1, as DeepSpeed's
    launcher sets it on one node): every socket either rank listens on, the store's and gloo's,
    is on 127.0.0.1."""
    port = free_port()
    env = subprocess_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env = {k: v for k, v in env.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    ranks = ranks_of("tests.support.listening_worker", 2, env)
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-3000:]
    reports = [json.loads(rank.stdout.strip().splitlines()[-1]) for rank in ranks]
    listening = [address for report in reports for address in report["listening"]]
    assert f"127.0.0.1:{port}" in reports[0]["listening"]  # the store
    assert len(listening) >= 3  # the store, and a gloo listener on each rank
    assert all(address.startswith("127.0.0.1:") for address in listening), listening


def test_the_preflights_test_listener_listens_on_the_master_address_alone():
    """netprobe's `listen`, run on node 0 while the other nodes try the master's port: it answers
    on the master address, where the rendezvous will listen, and nowhere else."""
    port = free_port()
    result: dict = {}
    listener = threading.Thread(
        target=lambda: result.update(netprobe.listen("127.0.0.1", port, 3)), daemon=True
    )
    listener.start()
    wait_for(lambda: _answers("127.0.0.1", port), what="the test listener")
    assert not _answers(ELSEWHERE, port)
    listener.join(timeout=30)
    assert result["accepted"] >= 1
