"""Looking at the host's processes (the host is this machine): what runs under a directory."""

from __future__ import annotations

import os
from pathlib import Path


def processes_under(directory: Path) -> list[int]:
    """Pids of live processes whose working directory is inside `directory`."""
    root = str(directory.resolve())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (cwd == root or cwd.startswith(root + "/")):
            found.append(int(entry))
    return found


def train_stage_process(workspace: Path) -> int | None:
    """The pid of `python -m clipforge.train` running in `workspace`."""
    for pid in processes_under(workspace):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"clipforge.train" in argv and b"-m" in argv:
            return pid
    return None


def environment_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def files_containing(directory: Path, needle: str) -> list[Path]:
    data = needle.encode()
    return [
        p
        for p in directory.rglob("*")
        if p.is_file() and not p.is_symlink() and data in p.read_bytes()
    ]
