"""Run by test_rendezvous_binding.py as each rank of a process group on this machine: joins the
group as the train stage does (clipforge.train.dist.init_distributed), then prints, as one JSON
line, every TCP address this process listens on (its sockets found in /proc/net/tcp{,6})."""

from __future__ import annotations

import json
import os
from pathlib import Path


def listening_addresses() -> list[str]:
    """host:port of each listening TCP socket of this process (hex from /proc, decoded)."""
    inodes = {
        link.split("[")[1].rstrip("]")
        for link in (os.readlink(fd) for fd in Path("/proc/self/fd").iterdir() if fd.exists())
        if link.startswith("socket:[")
    }
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for row in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]  # host-endian words
            packed = b"".join(words)
            host = ".".join(str(b) for b in packed) if width == 8 else packed.hex(":", 2)
            found.append(f"{host}:{int(port, 16)}")
    return sorted(found)


def main() -> None:
    import torch
    import torch.distributed as dist

    from clipforge.train.dist import init_distributed

    init_distributed("cpu")
    dist.all_reduce(torch.ones(1))
    print(json.dumps({"rank": dist.get_rank(), "listening": listening_addresses()}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    from clipforge.train.dist import exit_leaving_process_group

    exit_leaving_process_group(main)
