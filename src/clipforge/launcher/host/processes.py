"""A node's processes, found by their pid files and /proc: keeper, supervisor and the attempt.

Three processes keep one node's run (clipforge.launcher.host.keeper, .supervisor): the keeper,
which only waits on the supervisor and starts a new one when it dies; the supervisor; and the
attempt of a phase that the supervisor runs (`dvc exp run ...`, the DeepSpeed launcher, `docker
run ...`), the leader of its own process group. A pid file can outlive its process and a pid can
be reused, so each is recognised by what it is, not by its number alone: the keeper and the
supervisor by their command line (their module and this node's directory), the attempt by its
environment, which names this node's progress folder (clipforge.progress, set by the supervisor
for every attempt it starts).

When a supervisor dies its attempt goes on, a child of the keeper (a subreaper): the keeper writes
its exit status to NODE_DIR/reaped/<pid> before it reaps it, and the supervisor that adopted the
attempt reads it there (`attempt_end`). Standard library only (clipforge.launcher.host).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from clipforge.fsutil import atomic_write_text
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.progress import PROGRESS_DIR_ENV

SUPERVISOR_MODULE = "clipforge.launcher.host.supervisor"
KEEPER_MODULE = "clipforge.launcher.host.keeper"


def _module_pid(pid_file: str, module: str, layout: NodeLayout) -> int | None:
    """The pid in `pid_file` when that process runs `module` on this node, else None."""
    try:
        pid = int(Path(pid_file).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if runs_module(pid, module, layout) else None


def runs_module(pid: int, module: str, layout: NodeLayout) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return module.encode() in cmdline and layout.node_dir.encode() in cmdline and not _zombie(pid)


def supervisor_pid(layout: NodeLayout) -> int | None:
    """The pid of this node's live supervisor, or None (a stale pid file is not a live one)."""
    return _module_pid(layout.pid_file, SUPERVISOR_MODULE, layout)


def keeper_pid(layout: NodeLayout) -> int | None:
    """The pid of this node's live keeper, or None."""
    return _module_pid(layout.keeper_pid_file, KEEPER_MODULE, layout)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, parent pid, process group) of a process; None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[2])


def _zombie(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] == "Z"


def attempt_running(pid: int | None, layout: NodeLayout) -> bool:
    """Whether `pid` is a live attempt of this node: not a zombie, and started by a supervisor
    of this node (its environment names the node's progress folder)."""
    if not pid or _stat(pid) is None or _zombie(pid):
        return False
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # another user's process: not ours
        return False
    return f"{PROGRESS_DIR_ENV}={layout.progress_dir}".encode() in environ


@dataclass(frozen=True)
class Ended:
    """An adopted attempt that ended: its exit code (negative: its signal), None if unknown."""

    code: int | None


def attempt_end(pid: int, layout: NodeLayout) -> Ended | None:
    """None while the attempt `pid` runs (or has just ended and its keeper is about to record
    it); once it ended, its exit code as the keeper recorded it, or an unknown one (another
    process reaped it: no keeper, or one started after the attempt ended)."""
    if attempt_running(pid, layout):
        return None
    code = reaped_code(layout, pid)
    if code is not None:
        return Ended(code)
    stat = _stat(pid)
    if stat is not None and stat[0] == "Z" and runs_module(stat[1], KEEPER_MODULE, layout):
        return None  # the keeper writes its status, then reaps it
    return Ended(None)


def record_reaped(layout: NodeLayout, pid: int, code: int) -> None:
    """The keeper's record of an orphan's exit, written before it reaps that orphan."""
    os.makedirs(layout.reaped_dir, exist_ok=True)
    atomic_write_text(os.path.join(layout.reaped_dir, str(pid)), f"{code}\n")


def reaped_code(layout: NodeLayout, pid: int) -> int | None:
    try:
        return int(Path(layout.reaped_dir, str(pid)).read_text().strip())
    except (OSError, ValueError):
        return None


def become_subreaper() -> None:
    """Orphans of this process's descendants become its children (reaped here), not init's."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER (Linux >= 3.4)
    except (OSError, AttributeError):
        pass  # not Linux: orphans go to init, which reaps them on ordinary hosts


def group_alive(group: int) -> bool:
    """Whether process group `group` has a member that is not a zombie: an orphan nobody reaps
    (PID 1 of a container that does not) is no process to wait for."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True  # nothing to tell a zombie by: killpg found the group
    for entry in os.listdir("/proc"):
        stat = _stat(int(entry)) if entry.isdigit() else None
        if stat is not None and stat[0] != "Z" and stat[2] == group:
            return True
    return False
