"""Which interface each node's ranks talk on, from what the network probe really answers on this
machine: a route to the master by loopback is fine only when every node is on one network stack
(the quick start's two nodes on one box), never across stacks (separate machines or namespaces,
whose peers could not connect back to a loopback address)."""

from __future__ import annotations

from clipforge.launcher.host import netprobe
from clipforge.launcher.network import routed_interfaces

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
