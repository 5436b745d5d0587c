"""Which interface each node's ranks talk on, from what the network probe really answers on this
machine: a route to the master by loopback is fine only when every node is on one network stack
(the quick start's two nodes on one box), never across stacks (separate machines or namespaces,
whose peers could not connect back to a loopback address). Which address the master listens on:
a private one first."""

from __future__ import annotations

import pytest

from clipforge.errors import LauncherError
from clipforge.launcher.host import netprobe
from clipforge.launcher.network import first_private, is_private, routed_interfaces

MASTER = "127.0.0.1"


def test_nodes_on_one_network_stack_talk_on_loopback():
    here = netprobe.route(MASTER)
    assert here["interface"] == "lo" and here["stack"]
    chosen = routed_interfaces([here, netprobe.route(MASTER)], MASTER)
    assert [(i.name, i.error) for i in chosen] == [("lo", None), ("lo", None)]


def test_a_loopback_route_across_network_stacks_is_refused():
    here = netprobe.route(MASTER)
    elsewhere = {**here, "stack": "another-boot:1"}
    chosen = routed_interfaces([here, elsewhere], MASTER)
    assert all(i.name is None for i in chosen)
    assert "leaves by lo" in chosen[1].error and "could not connect back" in chosen[1].error


def test_a_node_whose_stack_is_unknown_never_counts_as_the_same_box():
    here = netprobe.route(MASTER)
    unknown = {**here, "stack": None}
    assert all(i.error for i in routed_interfaces([unknown, unknown], MASTER))


def test_private_addresses_are_the_sites_own_networks():
    """RFC 1918, CGNAT, link-local and loopback (ULA, link-local and ::1 for IPv6) are private;
    everything else, documentation ranges included, counts as public."""
    for address in ("10.1.2.3", "172.31.0.9", "192.168.1.1", "100.64.0.1", "169.254.3.4",
                    "127.0.0.1", "fd12::1", "fe80::1", "::1"):  # fmt: skip
        assert is_private(address), address
    for address in ("8.8.8.8", "172.32.0.1", "100.128.0.1", "198.51.100.11", "192.0.2.2", "2001:db8::1"):  # fmt: skip
        assert not is_private(address), address


def test_the_master_is_node_0s_first_private_address_whatever_comes_first():
    """A rented box lists its public address first: the rendezvous takes the private one; with
    only public ones, the first (for `fab train` to refuse unless --allow-public-master)."""
    box = {"lo": "127.0.0.1", "eth0": "203.0.113.5", "eth1": "10.0.0.5", "eth2": "10.0.1.5"}
    assert first_private(box, "box") == "10.0.0.5"
    assert first_private({"lo": "127.0.0.1", "eth0": "203.0.113.5"}, "box") == "203.0.113.5"
    with pytest.raises(LauncherError, match="box: no network interface but loopback"):
        first_private({"lo": "127.0.0.1"}, "box")
