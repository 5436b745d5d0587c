"""Writes that are all-or-nothing: a reader never sees a half-written file or directory.

What is written gets the mode any tool would give it: 0666 / 0777 less the umask (tempfile's
mkstemp and mkdtemp make private files, unreadable to teammates on shared storage), or the mode
of the file it replaces. A run's processes (each stage, the host's supervisor, the image's
entry point, the launcher's commands that make a run's folders) first add RUN_UMASK to theirs
(`restrict_umask`): on a shared host what a run writes is group-readable at most (files 0640,
folders 0750 under the usual umask 022), never readable by every user of the box, and a stricter
umask (077) stays. What a library writes with a mode of its own (safetensors makes 0600 files)
gets the same mode as the rest (`give_default_modes`): one mode for every file of an export.

Names from outside (a host, a run store, an archive) become local paths through one checked join,
`join_inside`: a name that would land outside its folder is refused before anything is written.

Standard library only: the launcher's host side (clipforge.launcher.host) writes through it, under
a host's own python3.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from clipforge.errors import UserError
from clipforge.util import short_repr

log = logging.getLogger("clipforge.fsutil")

MAX_NAME_BYTES = 255  # one path component, as Linux file systems take it
RUN_UMASK = 0o027  # no write for the group, nothing for others


def restrict_umask() -> int:
    """Add RUN_UMASK to this process's umask (and its children's), keeping what it takes away
    already; returns the umask it had (for a caller in someone else's process to put back)."""
    previous = os.umask(0o077)
    os.umask(previous | RUN_UMASK)
    return previous


def give_default_modes(folder: str | Path) -> None:
    """Every file and folder under `folder` (itself too) to the mode a new one gets here:
    0666 / 0777 less the umask, whatever mode the library that wrote it chose."""
    umask = os.umask(0o077)
    os.umask(umask)
    folder = Path(folder)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


class UnsafeNameError(UserError, ValueError):
    """A name from outside that would not stay inside its folder, or that no folder should hold
    (a control character, an over-long component); the message names it and where it came from."""


def join_inside(folder: str | Path, name: str, source: str) -> Path:
    """`folder/name` for a relative `name` that came from outside (`source` says whose: a host, a
    run store, an archive), once it is certain to stay inside `folder`: no absolute path, no
    empty, `.` or `..` component, no control character, no component over 255 bytes, and no
    symbolic link below `folder` on the way (a write would follow it elsewhere). UnsafeNameError
    naming it otherwise. Nothing is created here: callers check every name before writing any."""
    problem = _name_problem(name)
    path = Path(folder)
    if problem is None:
        for part in name.split("/"):
            path = path / part
            if path.is_symlink():
                problem = f"{path} is a symbolic link"
                break
    if problem:
        raise UnsafeNameError(
            f"{source} names {short_repr(name)}, which would not stay inside {folder} ({problem}); "
            "nothing was written"
        )
    return path


def _name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not name:
        return "not a file name"
    if any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in name):
        return "a control character or undecodable byte"
    if name.startswith("/"):
        return "an absolute path"
    for part in name.split("/"):
        if part in ("", ".", ".."):
            return f"a {part!r} component" if part else "an empty component"
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            return f"a component over {MAX_NAME_BYTES} bytes"
    return None


class AtomicFile:
    """A temporary file that `commit` renames over its destination (see `atomic_file`)."""

    def __init__(self, path: Path):
        self.path = path
        self.committed = False

    def commit(self, target: str | Path) -> None:
        with contextlib.suppress(FileNotFoundError):  # a replaced file keeps its mode...
            replaced = os.lstat(target)
            if stat.S_ISREG(replaced.st_mode):  # ...never a link's target's: the link is replaced
                os.chmod(self.path, stat.S_IMODE(replaced.st_mode))
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
    name = _create_unique(
        directory, prefix, suffix, lambda p: os.close(os.open(p, _NEW_FILE, 0o666))
    )
    staged = AtomicFile(name)
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
    tmp = _create_unique(target.parent, _sibling_prefix(target, "partial"), "", os.mkdir)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = _create_unique(target.parent, _sibling_prefix(target, "old"), "", os.mkdir)
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


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def _create_unique(
    directory: Path, prefix: str, suffix: str, create: Callable[[Path], None]
) -> Path:
    """A new file or directory of a name no one else holds. `create` makes it with the mode any
    tool would use (os.open 0666, os.mkdir 0777), which the kernel reduces by the umask."""
    while True:
        path = directory / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            create(path)
        except FileExistsError:
            continue
        return path


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
