"""Writes that are all-or-nothing: a reader never sees a half-written file or directory.

Standard library only: the launcher's host side (clipforge.launcher.host) writes through it, under
a host's own python3.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("clipforge.fsutil")


class AtomicFile:
    """A temporary file that `commit` renames over its destination (see `atomic_file`)."""

    def __init__(self, path: Path):
        self.path = path
        self.committed = False

    def commit(self, target: str | Path) -> None:
        with contextlib.suppress(FileNotFoundError):  # mkstemp made it private: keep the old mode
            os.chmod(self.path, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(self.path, target)
        self.committed = True


@contextlib.contextmanager
def atomic_file(
    directory: str | Path, prefix: str = ".tmp-", suffix: str = ""
) -> Iterator[AtomicFile]:
    """A temporary file in `directory` for any writer, a streaming one included, whose destination
    may be known only once it is written. `commit(path)` (a path on the same file system) renames
    it over `path` in one step, so a reader sees the old file or the whole new one; a file not
    committed is removed when the block ends, error or not."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    os.close(fd)
    staged = AtomicFile(Path(name))
    try:
        yield staged
    finally:
        if not staged.committed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    with atomic_file(path.parent, prefix=f".{path.name}.") as staged:
        with open(staged.path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        staged.commit(path)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def replace_dir_atomically(target: str | Path) -> Iterator[Path]:
    """Yield an empty sibling directory; on success it replaces `target`, on error it is removed.

    The old directory is renamed away before the new one is renamed in, so an interruption
    leaves either the old or the new content at `target` (plus a `.old-*` sibling at worst).
    A process killed outright (SIGKILL, a lost machine) cannot remove its sibling: the names
    carry the writer's process id, and the next replacement of `target` removes those whose
    writer is gone.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(target)
    tmp = Path(tempfile.mkdtemp(prefix=_sibling_prefix(target, "partial"), dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the result is a normal directory
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=_sibling_prefix(target, "old"), dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sibling_prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{os.getpid()}-"


def remove_stale_siblings(target: str | Path) -> list[Path]:
    """Remove the `.partial-*` / `.old-*` siblings of `target` left by writers that no longer
    run (a sibling without a process id in its name predates them: stale too). Returns them."""
    target = Path(target)
    removed = []
    for kind in ("partial", "old"):
        for sibling in target.parent.glob(f".{target.name}.{kind}-*"):
            pid = sibling.name[len(f".{target.name}.{kind}-") :].split("-", 1)[0]
            if sibling.is_dir() and not (pid.isdigit() and _running(int(pid))):
                log.info("removing %s, left by an interrupted run", sibling)
                shutil.rmtree(sibling, ignore_errors=True)
                removed.append(sibling)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
