"""One run, one writer: an advisory lock on the run directory.

An advisory lock on the run directory (the run store's lease, its
counterpart there, is clipforge.store.lease).

The lock is `flock` on `<run dir>/writer.lock`, which holds who has it (host, pid, start time).
A second trainer of the same run directory refuses in one line naming the holder. The kernel
drops the lock when its process ends, however it ends, so a lock left by a dead process is no
lock: the next trainer takes it (and says whose it was). That is also how the supervisor's
restarts take the run over: its trainer has exited before the next one starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from clipforge.checkpoints.access import denied
from clipforge.checkpoints.layout import WRITER_LOCK
from clipforge.errors import StageError

log = logging.getLogger(__name__)


class RunBusy(StageError):
    """Another live trainer holds the run: not a fault a restart repeats, since it may end."""

    fault = None


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started_at: str  # UTC, ISO 8601
    token: str = ""  # tells two holders with the same host and pid apart (the store's lease)

    @classmethod
    def this_process(cls) -> Holder:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            token=secrets.token_hex(8),
        )

    @classmethod
    def parse(cls, data: bytes | str | None) -> Holder | None:
        try:
            value = json.loads(data or b"")
            return cls(
                host=str(value["host"]),
                pid=int(value["pid"]),
                started_at=str(value["started_at"]),
                token=str(value.get("token", "")),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started_at}"

    def to_json(self, **extra) -> str:
        return json.dumps({**asdict(self), **extra}, indent=1) + "\n"


class RunLock:
    """The lock of one run directory, held by this process until `release` (or its end)."""

    def __init__(self, run_dir: Path, holder: Holder, fd: int, made: list[Path]):
        self.path = run_dir / WRITER_LOCK
        self.holder = holder
        self._fd: int | None = fd
        self._made = made  # the folders taking the lock created, innermost first

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays, telling who had it
            self._fd = None

    def abandon(self) -> None:
        """Release after a start that wrote nothing: the lock file goes with the folders taking
        it created, when they hold nothing else, so a refused start leaves no trace."""
        if self._fd is not None and [p.name for p in self.path.parent.iterdir()] == [WRITER_LOCK]:
            self.path.unlink()
            for folder in self._made:
                with contextlib.suppress(OSError):  # not empty: something else lives there
                    folder.rmdir()
        self.release()


def lock_run_dir(run_dir: Path, holder: Holder | None = None) -> RunLock:
    """Take the run directory's lock; StageError naming the holder when a live process has it."""
    holder = holder or Holder.this_process()
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / WRITER_LOCK
    # Held through a read-only descriptor (flock needs no write access): a disk that goes
    # read-only under a run (remounted, or by the kernel after an error) must not be kept busy.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    except PermissionError:
        raise denied(path if os.path.lexists(path) else run_dir, "open the lock") from None
    except IsADirectoryError:
        raise StageError(
            f"{path} is a folder, not a lock file: remove it (`rm -r {path}`), then rerun"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = Holder.parse(_read_fd(fd))
        os.close(fd)
        who = other.describe() if other else "another process"
        raise RunBusy(
            f"{run_dir} is being trained by {who} (lock {path}): one run has one writer; wait "
            f"for it to end or stop it, then rerun"
        ) from None
    previous = Holder.parse(_read_fd(fd))
    if previous and previous.token != holder.token:
        log.info("%s: taking over the lock of %s, which has ended", run_dir, previous.describe())
    try:
        with open(path, "w", encoding="utf-8") as f:  # under the lock: nobody else writes it
            f.write(holder.to_json())
            f.flush()
            os.fsync(f.fileno())
    except PermissionError:
        os.close(fd)
        raise denied(path, "write") from None
    return RunLock(run_dir, holder, fd, made)


def _read_fd(fd: int) -> bytes:
    with contextlib.suppress(OSError):
        return os.pread(fd, 65536, 0)
    return b""
