"""Other machines on this one: network namespaces joined by a switch, each host with its own sshd.

    with test_network(tmp_path, hosts=("a", "b")) as net:    # or the fixture `netns_hosts`
        a, b = net.hosts                  # a.address "10.213.0.11", a.sshd (user, key, port)
        fab = FabRunner(..., prefix=net.on_laptop)   # the client runs in a namespace of its own
        net.set_link(b, up=False)         # pull node b's cable

Topology: a namespace holding a bridge (the switch), a "laptop" namespace where the client runs,
and one namespace per host, each joined to the switch by a veth pair whose host end is `eth0`.
The switch is the nodes' private network: addresses from 10.213.0.0/24, which exist only inside
these namespaces. Every host runs its own sshd on port 22 with a throwaway host key; one client
key is authorized on all. Hosts share the filesystem, so a directory is "shared storage" between
them.

`test_network(..., public=("a",))` adds the internet: a second switch, an `outside` namespace on
it (OUTSIDE_ADDRESS) and, on each host named, an interface `wan0` with a public address from
198.51.100.0/24 (TEST-NET-2), made before `eth0` so that it comes first among the host's
interfaces, as on a rented box whose public address `hostname -I` lists first.

Inside each host's namespace the machine's hostname resolves to 127.0.1.1 (an /etc/netns/<ns>/hosts
that `ip netns exec` mounts over /etc/hosts, as Debian's default /etc/hosts has it): a program that
takes its address from the hostname gets the loopback, as on a fresh real box.

Teardown, also when a test fails: every process in the namespaces (sshd, and what it started) is
killed, the namespaces and their /etc/netns entries are removed. `NetnsUnavailable` when
namespaces cannot be created here (not root, no CAP_SYS_ADMIN): callers skip with its reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.sshd import SshServer, keygen, start_sshd

SUBNET = "10.213.0"
LAPTOP_ADDRESS = f"{SUBNET}.1"
PUBLIC_SUBNET = "198.51.100"
OUTSIDE_ADDRESS = f"{PUBLIC_SUBNET}.99"
SSH_PORT = 22
CLONE_NEWNET = 0x40000000


class NetnsUnavailable(RuntimeError):
    pass


@dataclass
class NetHost:
    name: str
    netns: str
    address: str
    sshd: SshServer | None = None
    public_address: str | None = None  # on wan0 (test_network's `public`)

    @property
    def ssh_target(self) -> str:
        return self.sshd.address


@dataclass
class TestNetwork:
    prefix: str
    switch: str  # namespace holding the bridge
    laptop: str  # namespace of the client
    hosts: list[NetHost] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    outside: str | None = None  # namespace on the public switch (test_network's `public`)

    __test__ = False  # a helper, not a pytest test class

    @property
    def on_laptop(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.laptop)

    @property
    def client_key(self) -> Path:
        return self.hosts[0].sshd.client_key

    def host_list(self, hosts: list[NetHost] | None = None) -> str:
        """`-H` for fab: the hosts in order (node rank)."""
        return ",".join(h.ssh_target for h in (hosts or self.hosts))

    def known_hosts(self) -> str:
        return "".join(h.sshd.known_hosts_line for h in self.hosts)

    def run(self, netns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return _ip("netns", "exec", netns, *argv, check=check)

    def set_link(self, host: NetHost, *, up: bool) -> None:
        """Bring the host's only interface down (or up again): it reaches no one, no one it."""
        _ip("-n", host.netns, "link", "set", "eth0", "up" if up else "down")
        if up:
            _ip("-n", host.netns, "route", "replace", f"{SUBNET}.0/24", "dev", "eth0")

    def pids(self, netns: str) -> list[int]:
        result = _ip("netns", "pids", netns, check=False)
        return [int(p) for p in result.stdout.split()]

    def close(self) -> None:
        for host in self.hosts:
            if host.sshd:
                host.sshd.process.terminate()
        for netns in self.namespaces:
            for pid in self.pids(netns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for host in self.hosts:
            if host.sshd:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.sshd.process.wait(timeout=10)
        for netns in reversed(self.namespaces):
            _ip("netns", "del", netns, check=False)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)


@contextlib.contextmanager
def test_network(
    directory: Path, hosts: tuple[str, ...] = ("a", "b"), public: tuple[str, ...] = ()
) -> Iterator[TestNetwork]:
    prefix = f"cf{os.getpid()}{'p' if public else ''}"
    net = TestNetwork(prefix=prefix, switch=f"{prefix}-sw", laptop=f"{prefix}-laptop")
    try:
        _add_namespace(net, net.switch)
        for bridge in ("sw0", "sw1") if public else ("sw0",):
            _ip("-n", net.switch, "link", "add", bridge, "type", "bridge")
            _ip("-n", net.switch, "link", "set", bridge, "up")
        _add_namespace(net, net.laptop)
        _plug(net, net.laptop, "laptop", LAPTOP_ADDRESS)
        if public:
            net.outside = f"{prefix}-out"
            _add_namespace(net, net.outside)
            _plug(net, net.outside, "outside", OUTSIDE_ADDRESS, "wan0", "sw1")
        client_key = keygen(directory / "client_key")
        for index, name in enumerate(hosts):
            host = NetHost(name=name, netns=f"{prefix}-{name}", address=f"{SUBNET}.{11 + index}")
            _add_namespace(net, host.netns)
            if name in public:
                host.public_address = f"{PUBLIC_SUBNET}.{11 + index}"
                _plug(net, host.netns, f"{name}-wan", host.public_address, "wan0", "sw1")
            _plug(net, host.netns, name, host.address)
            _resolve_hostname_to_loopback(host.netns)
            host.sshd = start_sshd(
                directory / f"sshd-{name}",
                listen=host.address,
                port=SSH_PORT,
                netns=host.netns,
                client_key=client_key,
            )
            net.hosts.append(host)
        yield net
    finally:
        net.close()


test_network.__test__ = False


def made_in_namespace(netns: str, make: Callable[[], object]):
    """make()'s result, called on a thread moved into `netns`: the sockets it opens live there
    for good (a socket keeps its namespace), e.g. a server that only the hosts can reach."""
    outcome: dict = {}

    def enter_and_make() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            with open(f"/run/netns/{netns}") as handle:
                if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns}")
            outcome["value"] = make()
        except BaseException as exc:  # handed to the calling thread
            outcome["error"] = exc

    thread = threading.Thread(target=enter_and_make)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _add_namespace(net: TestNetwork, netns: str) -> None:
    result = _ip("netns", "add", netns, check=False)
    if result.returncode != 0:
        raise NetnsUnavailable(f"cannot create a network namespace: {result.stderr.strip()}")
    net.namespaces.append(netns)
    _ip("-n", netns, "link", "set", "lo", "up")


def _plug(
    net: TestNetwork,
    netns: str,
    name: str,
    address: str,
    interface: str = "eth0",
    bridge: str = "sw0",
) -> None:
    """An interface of namespace `netns` at `address`, cabled to the switch's `bridge`."""
    port = f"p-{name}"[:15]
    _ip(
        "-n",
        net.switch,
        "link",
        "add",
        port,
        "type",
        "veth",
        "peer",
        "name",
        interface,
        "netns",
        netns,
    )
    _ip("-n", net.switch, "link", "set", port, "master", bridge, "up")
    _ip("-n", netns, "addr", "add", f"{address}/24", "dev", interface)
    _ip("-n", netns, "link", "set", interface, "up")


def _resolve_hostname_to_loopback(netns: str) -> None:
    etc = Path("/etc/netns") / netns
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "hosts").write_text(
        f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n", encoding="utf-8"
    )


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result
