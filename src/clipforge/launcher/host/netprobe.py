"""Network facts of a node, found on the node itself before a multi-node run starts.

The launcher sends this file's source to the host's python over SSH (`python3 -c SOURCE route
ADDR`): it runs before the run's code is shipped, so it is one standard-library file.

  route ADDR               the interface and source address this host uses to reach ADDR, and
                           which network stack it is (kernel boot and network namespace)
  interfaces               every interface with an IPv4 address, and that address
  listen ADDR PORT SECS    accept TCP connections on ADDR:PORT (that address alone, as the
                           rendezvous will listen) for up to SECS (prints `listening`)
  connect ADDR PORT SECS   one TCP connection to ADDR:PORT (prints `ok`, or the error)

Each prints one JSON object. The interface matters because torch.distributed's gloo (and NCCL)
otherwise bind to the address the hostname resolves to, often 127.0.0.1 or 127.0.1.1 in
/etc/hosts: every rank then tells its peers to connect to its loopback.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import sys
import time

SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


def interface_addresses() -> dict[str, str]:
    """name -> IPv4 address, for every interface that has one."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address
            found[name] = socket.inet_ntoa(raw[20:24])
    return found


def route(address: str) -> dict:
    """The source address the kernel picks toward `address` (a UDP connect sends nothing), and
    the interface that holds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
        except OSError as exc:
            return {"error": f"no route to {address}: {exc.strerror or exc}"}
        source = s.getsockname()[0]
    names = [n for n, a in interface_addresses().items() if a == source]
    return {"interface": names[0] if names else None, "address": source, "stack": network_stack()}


def network_stack() -> str | None:
    """One kernel's one network namespace: nodes that share it reach each other on loopback.
    None where /proc does not say (then no two nodes count as one stack)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None


def listen(address: str, port: int, seconds: float) -> dict:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((address, port))
        except OSError as exc:
            return {"error": f"cannot listen on {address} port {port}: {exc.strerror or exc}"}
        server.listen()
        print(json.dumps({"listening": port}), flush=True)
        server.settimeout(0.5)
        accepted, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                server.accept()[0].close()
                accepted += 1
            except TimeoutError:
                continue
    return {"accepted": accepted}


def connect(address: str, port: int, seconds: float) -> dict:
    try:
        socket.create_connection((address, port), timeout=seconds).close()
    except TimeoutError:
        return {"error": f"timed out after {seconds:g}s"}
    except OSError as exc:
        return {"error": exc.strerror or str(exc)}
    return {"ok": True}


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "route":
        result = route(args[0])
    elif command == "interfaces":
        result = interface_addresses()
    elif command == "listen":
        result = listen(args[0], int(args[1]), float(args[2]))
    elif command == "connect":
        result = connect(args[0], int(args[1]), float(args[2]))
    else:
        raise SystemExit(f"netprobe: unknown command {command!r}")
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
