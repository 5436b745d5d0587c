"""Multi-node networking, checked on the nodes before anything starts.

Multi-node networking, checked on the nodes before anything starts: where node 0 is reached,
which interface each node's ranks talk on, and whether every node reaches the master's port.

torch.distributed's gloo (and NCCL) take a node's address from its hostname unless told an
interface; on many fresh boxes the hostname resolves to 127.0.0.1 or 127.0.1.1, so each rank
advertises its loopback and the peers' connections are refused. Each node therefore gets
GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME: the interface its route to the master leaves by, or the
`socket_ifname` setting when the user names one. The run record keeps which, and why.

The master address is where node 0's rendezvous listens, and only there (clipforge.train.dist):
an unauthenticated store that whoever reaches it can join. It is node 0's address on the
`socket_ifname` interface, else its first private one (RFC 1918, CGNAT, link-local; ULA and
loopback for IPv6 too); a box with public addresses alone is refused unless `fab train
--allow-public-master` says the port is firewalled (docs/launcher.md).
"""

from __future__ import annotations

import ipaddress
import json
import time
from dataclasses import dataclass
from pathlib import Path

from clipforge.errors import LauncherError
from clipforge.launcher.connection import probe, q
from clipforge.launcher.host import netprobe
from clipforge.launcher.preflight import FAIL, OK, Row
from clipforge.launcher.session import Host, Settings
from clipforge.launcher.stack import StackOutputs
from clipforge.train.dist import SOCKET_IFNAME_VARS

CONNECT_TIMEOUT_SECONDS = 5.0
LISTEN_SECONDS = 60.0  # node 0's test listener ends by itself, should the launcher vanish
_PROBE_SOURCE = Path(netprobe.__file__).read_text(encoding="utf-8")


ROUTE = "route to the master"
SETTING = "setting clipforge.socket_ifname"


@dataclass(frozen=True)
class NodeInterface:
    name: str | None  # None: no usable route (`error` says why)
    address: str | None
    chosen_by: str  # ROUTE or SETTING
    error: str | None = None


# The networks no one outside the site reaches: RFC 1918, shared (CGNAT) space, link-local,
# loopback; IPv6 unique-local (ULA), link-local and loopback.
PRIVATE_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16",
              "127.0.0.0/8", "fc00::/7", "fe80::/10", "::1/128")
)  # fmt: skip


def is_private(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return any(ip in network for network in PRIVATE_NETWORKS if network.version == ip.version)


def master_address(
    host: Host, stack: StackOutputs | None, settings: Settings, allow_public: bool
) -> str:
    """Where the other nodes reach node 0 and its rendezvous listens: its cluster DNS name on a
    stack (the cluster's own network); else the address of node 0's interface `socket_ifname`
    names, or its first private one (`first_private`). A public one only with `allow_public`."""
    if stack:
        return host.cxn.host
    if settings.socket_ifname:
        named = _named_interface(host, settings)
        if named.error:
            raise LauncherError(
                f"{host.label}: {named.error}; check clipforge.socket_ifname; nothing was started"
            )
        address = str(named.address)
    else:
        address = first_private(_run_probe(host, settings, "interfaces"), host.label)
    if not (is_private(address) or allow_public):
        raise LauncherError(
            f"{host.label}: the rendezvous would listen on the public address {address}, where "
            "anyone can join the run's unauthenticated store; set clipforge.socket_ifname to "
            "the interface of a private network between the nodes, or firewall --master-port to "
            "the nodes and pass --allow-public-master (docs/launcher.md); nothing was started"
        )
    return address


def first_private(interfaces: dict[str, str], label: str) -> str:
    """The first private address among a node's interfaces but loopback (in the kernel's order),
    else the first address: public, for the caller to refuse or allow."""
    others = [a for a in interfaces.values() if not ipaddress.ip_address(a).is_loopback]
    if not others:
        raise LauncherError(f"{label}: no network interface but loopback for the rendezvous")
    return next((a for a in others if is_private(a)), others[0])


def socket_env(interface: NodeInterface | None) -> dict[str, str]:
    """The ranks' environment for `interface` (None: a single node, nothing to choose)."""
    name = interface.name if interface else None
    return {var: name for var in SOCKET_IFNAME_VARS} if name else {}


def check_nodes(
    hosts: list[Host], master: str, port: int, settings: Settings
) -> tuple[list[list[Row]], list[NodeInterface]]:
    """A `network` row per node, and each node's interface toward the master."""
    if settings.socket_ifname:
        interfaces = [_named_interface(h, settings) for h in hosts]
    else:
        routes = [_run_probe(h, settings, "route", master) for h in hosts]
        interfaces = routed_interfaces(routes, master)
    rows = [[_route_row(iface, master)] for iface in interfaces]
    listener = _start_listener(hosts[0], master, port, settings)
    try:
        if listener.error:
            rows[0].append(Row("rendezvous", FAIL, f"{listener.error} (--master-port)"))
        else:
            rows[0].append(
                Row("rendezvous", OK, f"port {port} free on the master {master}, listening there")
            )
            for host, host_rows in zip(hosts[1:], rows[1:]):
                host_rows.append(_reach_row(host, master, port, settings))
    finally:
        listener.stop()
    return rows, interfaces


def _named_interface(host: Host, settings: Settings) -> NodeInterface:
    addresses = _run_probe(host, settings, "interfaces")
    name = settings.socket_ifname
    if name not in addresses:
        found = ", ".join(sorted(addresses)) or "none"
        error = f"no interface {name} with an IPv4 address here (found: {found})"
        return NodeInterface(None, None, SETTING, error)
    return NodeInterface(name, addresses[name], SETTING)


def routed_interfaces(routes: list[dict], master: str) -> list[NodeInterface]:
    """Each node's interface from its `netprobe route MASTER` answer. A route by loopback is
    refused unless every node is on one network stack (nodes sharing a box and its network
    namespace do reach each other there)."""
    stacks = {r.get("stack") for r in routes}
    one_stack = len(stacks) == 1 and None not in stacks
    return [_routed_interface(r, master, one_stack) for r in routes]


def _routed_interface(found: dict, master: str, one_stack: bool) -> NodeInterface:
    name, address = found.get("interface"), found.get("address")
    if "error" in found:
        error = found["error"]
    elif name is None or (name == "lo" and not one_stack):
        error = (
            f"the route to the master {master} leaves by {name or 'no interface'} "
            f"(source {address}): the other nodes could not connect back"
        )
    else:
        error = None
    return NodeInterface(None if error else name, address, ROUTE, error)


def _route_row(interface: NodeInterface, master: str) -> Row:
    if interface.error:
        return Row(
            "network",
            FAIL,
            f"{interface.error}; check the routes between the nodes, or set "
            f"clipforge.socket_ifname (FABRIC_CLIPFORGE_SOCKET_IFNAME) to the interface of the "
            f"network between them",
        )
    if interface.chosen_by == SETTING:
        return Row(
            "network", OK, f"ranks talk on {interface.name} ({interface.address}, {SETTING})"
        )
    return Row(
        "network",
        OK,
        f"ranks talk on {interface.name} ({interface.address}), the route to {master}",
    )


def _reach_row(host: Host, master: str, port: int, settings: Settings) -> Row:
    found = _run_probe(host, settings, "connect", master, str(port), str(CONNECT_TIMEOUT_SECONDS))
    if "error" in found:
        return Row(
            "rendezvous",
            FAIL,
            f"cannot reach the master {master}:{port} ({found['error']}): check the link, "
            f"routes and firewall between the nodes",
        )
    return Row("rendezvous", OK, f"reaches the master {master}:{port}")


def _run_probe(host: Host, settings: Settings, *args: str) -> dict:
    # The source as an argument: Invoke copies an in_stream to the channel a byte at a time.
    result = probe(host.cxn, _probe_command(settings, *args))
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise LauncherError(
            f"{host.label}: the network probe failed: {(result.stderr or result.stdout).strip()[-300:]}"
        ) from None


def _probe_command(settings: Settings, *args: str) -> str:
    return f"{q(settings.python)} -c {q(_PROBE_SOURCE)} {' '.join(q(a) for a in args)}"


@dataclass
class _Listener:
    host: Host
    pid: str | None
    output: str
    error: str | None

    def stop(self) -> None:
        if self.pid:
            probe(self.host.cxn, f"kill {q(self.pid)} 2>/dev/null; rm -f {q(self.output)}")


def _start_listener(host: Host, address: str, port: int, settings: Settings) -> _Listener:
    """A TCP listener on node 0's rendezvous address and port, as the rendezvous will listen,
    detached from the SSH channel, while the other nodes try to connect; it also proves the port
    is free."""
    started = probe(
        host.cxn,
        f"out=$(mktemp /tmp/clipforge-netprobe.XXXXXX) || exit 1; "
        f"setsid {_probe_command(settings, 'listen', address, str(port), f'{LISTEN_SECONDS:g}')} "
        f'> "$out" 2>&1 < /dev/null & echo "$! $out"',
    )
    pid, _, output = started.stdout.strip().partition(" ")
    listener = _Listener(host, pid or None, output, None)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = probe(host.cxn, f"cat {q(output)}").stdout.strip().splitlines()
        if lines:
            try:
                listener.error = json.loads(lines[0]).get("error")
            except json.JSONDecodeError:
                listener.error = f"the test listener on the master failed: {lines[-1][:200]}"
            return listener
        time.sleep(0.2)
    listener.error = "the test listener on the master did not start"
    return listener
