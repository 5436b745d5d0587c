"""Run state this process may not read or write, found before anything is moved: one line each.

On shared storage a run folder may hold a teammate's files: a step folder at 0700, a manifest
at 0600, a `writer.lock` of another uid, a `latest` that is a folder or a link. Reading on regardless
ends in a traceback halfway through the start, or worse, in a checkpoint set aside as damaged
when it was only unreadable. So the start checks every file it will read or lock first
(`check_run_state`) and stops with one line naming the path, its mode and owner, and the remedy;
nothing is renamed, removed or written before. The writes that fail later anyway (a lock file
another user owns) say the same through `denied`.

Modes are what the kernel enforces for this process: root reads everything unless its
capabilities say otherwise, so the checks open and list for real rather than compare mode bits.
Standard library only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from clipforge.checkpoints.layout import CHECKPOINT_MANIFEST, LATEST, WRITER_LOCK, tag_step
from clipforge.errors import AccessDenied, StageError


def who_owns(path: Path) -> str:
    """`path`'s mode and owner, as `ls -l` says them, and who this process is."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"its mode cannot be read: {exc.strerror}"
    return (
        f"mode {stat.filemode(info.st_mode)}, owner {_user(info.st_uid)}, group "
        f"{_group(info.st_gid)}; this process runs as {_user(os.geteuid())}"
    )


def denied(path: Path, doing: str) -> AccessDenied:
    """The error for a file or folder this process may not `doing` (read, list, write...)."""
    return AccessDenied(
        f"cannot {doing} {path} ({who_owns(path)}): give this user access to it (`chmod`/"
        f"`chown` by its owner or root) or train into checkpoints of your own (--checkpoints); "
        f"nothing was changed"
    )


def check_run_state(run_dir: Path) -> None:
    """Everything the start of a run reads or locks in `run_dir`: the folder itself, its
    `writer.lock` and `latest`, every checkpoint folder with its manifest and files. The first
    problem found, as AccessDenied (a mode or owner) or StageError (a file where a folder
    belongs, or the reverse; a link as `latest`)."""
    if not os.path.lexists(run_dir):
        return  # made by the lock, under a checkpoints folder the stage found writable
    if not run_dir.is_dir():
        raise StageError(f"{run_dir} is not a folder: move it away, then rerun")
    _list(run_dir)
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise denied(run_dir, "write into")
    _check_lock(run_dir / WRITER_LOCK)
    _check_marker(run_dir / LATEST)
    for name in sorted(os.listdir(run_dir)):
        if tag_step(name) is not None and (run_dir / name).is_dir():
            _check_checkpoint(run_dir / name)


def _check_lock(path: Path) -> None:
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_file():
        raise StageError(
            f"{path} is not a lock file ({who_owns(path)}): it holds no lock of clipforge's; "
            f"remove it (`rm -r {path}`), then rerun"
        )
    _read(path)
    if not os.access(path, os.W_OK):  # the lock names its holder: it is rewritten
        raise denied(path, "write")


def _check_marker(path: Path) -> None:
    if not os.path.lexists(path):
        return
    if path.is_symlink():
        raise StageError(
            f"{path} is a symbolic link (to {os.readlink(path)}), not the marker clipforge "
            f"writes: a rewrite would follow it; remove it (`rm {path}`), then rerun (the run "
            f"resumes from its newest checkpoint that verifies)"
        )
    if not path.is_file():
        raise StageError(
            f"{path} is not a file ({who_owns(path)}), not the marker clipforge writes: the "
            f"next save could not replace it; remove it (`rm -r {path}`), then rerun (the run "
            f"resumes from its newest checkpoint that verifies)"
        )
    _read(path)


def _check_checkpoint(folder: Path) -> None:
    """The folder, its manifest and every file under it: all read by the start (hashes)."""
    for top, _, names in os.walk(folder, onerror=_raise):
        _list(Path(top))
        for name in sorted(names, key=lambda n: n != CHECKPOINT_MANIFEST):  # the manifest first
            _read(Path(top) / name)


def _raise(error: OSError) -> None:
    if isinstance(error, PermissionError) and error.filename:
        raise denied(Path(error.filename), "list")
    raise error


def _list(folder: Path) -> None:
    try:
        os.listdir(folder)
    except PermissionError:
        raise denied(folder, "list") from None
    if not os.access(folder, os.X_OK):  # listed, but its files cannot be opened
        raise denied(folder, "open the files of")


def _read(path: Path) -> None:
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        raise denied(path, "read") from None


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        import grp

        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except (ImportError, KeyError):
        return f"gid {gid}"
