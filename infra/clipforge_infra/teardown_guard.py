"""Teardown guard: refuse to release the GPUs while the latest checkpoint could be lost.

`make down` runs it first. The latest checkpoint is the tag named by ``latest`` in the most recently
modified ``run-<12 hex>`` directory (the train stage's layout). It counts as safe when

- it lies on retained storage: its real path (symlinks resolved) is under one of ``--retained``
  (default /workspace/checkpoints, the mount path of the stack's protected checkpoints volume), or
- every file of it is in the DVC remote: DVC 3 stores content by MD5 at
  ``<remote>/files/md5/<2 hex>/<30 hex>``, so the check needs no dvc.lock entry and also covers a
  checkpoint written after the last `dvc commit`. The default remote is asked of DVC itself
  (`dvc config`), so a remote set in the global or system config counts as DVC would count it.

Otherwise it exits non-zero, saying what to do, unless ``--force`` (FORCE=1). No checkpoint at all
means nothing to lose. Standard library only (DVC is run as a command): it also runs inside the
worker image.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

RUN_DIR_RE = re.compile(r"^run-[0-9a-f]{12}$")
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
DEFAULT_RETAINED = "/workspace/checkpoints"
EXIT_REFUSED = 3
_MD5_CHUNK_BYTES = 8 * 2**20


class GuardError(RuntimeError):
    """The guard could not decide (unreadable `latest`, unlistable remote): treated as a refusal."""


@dataclass(frozen=True)
class LatestCheckpoint:
    run_dir: Path
    tag: str

    @property
    def tag_dir(self) -> Path:
        return self.run_dir / self.tag

    def __str__(self) -> str:
        return f"{self.run_dir.name}/{self.tag}"


@dataclass(frozen=True)
class Verdict:
    safe: bool
    reason: str


class RemoteStore(Protocol):
    description: str

    def has(self, md5: str) -> bool: ...


def dvc_command() -> str:
    """The dvc next to this interpreter (`make down` runs the venv's Python without activating
    the venv, so its bin/ may not be on PATH), else the one on PATH."""
    beside = Path(sys.executable).with_name("dvc")
    return str(beside) if beside.is_file() else "dvc"


class LocalDvcRemote:
    """A DVC remote that is a directory here (local disk, NFS mount)."""

    def __init__(self, root: Path):
        self.root = root
        self.description = f"DVC remote {root}"

    def has(self, md5: str) -> bool:
        return (self.root / "files" / "md5" / md5[:2] / md5[2:]).is_file()


class ListedDvcRemote:
    """A DVC remote behind a URL (s3://, gs://, ssh://...), listed with `dvc ls-url` per hash prefix."""

    def __init__(self, url: str, dvc: str | None = None):
        self.url = url.rstrip("/")
        self.dvc = dvc or dvc_command()
        self.description = f"DVC remote {url}"
        self._listed: dict[str, set[str]] = {}

    def has(self, md5: str) -> bool:
        prefix = md5[:2]
        if prefix not in self._listed:
            self._listed[prefix] = self._list(f"{self.url}/files/md5/{prefix}")
        return md5[2:] in self._listed[prefix]

    def _list(self, url: str) -> set[str]:
        try:
            done = subprocess.run(
                [self.dvc, "ls-url", url], capture_output=True, text=True, check=False
            )
        except FileNotFoundError:
            raise GuardError(
                f"cannot check {self.description}: the dvc command is not installed"
            ) from None
        if done.returncode != 0:
            if "does not exist" in done.stderr:
                return set()
            raise GuardError(f"cannot list {url}: {done.stderr.strip()}")
        return {
            line.strip().rsplit("/", 1)[-1] for line in done.stdout.splitlines() if line.strip()
        }


def find_latest_checkpoint(checkpoints_dir: Path) -> LatestCheckpoint | None:
    """The tag named by ``latest`` in the most recently modified run directory that has one."""
    if not checkpoints_dir.is_dir():
        return None
    runs = [
        path
        for path in checkpoints_dir.iterdir()
        if path.is_dir() and RUN_DIR_RE.match(path.name) and (path / "latest").is_file()
    ]
    if not runs:
        return None
    run_dir = max(runs, key=lambda path: (path.stat().st_mtime, path.name))
    tag = (run_dir / "latest").read_text().strip()
    if not TAG_RE.match(tag):
        raise GuardError(f"{run_dir / 'latest'} does not hold a tag name")
    return LatestCheckpoint(run_dir=run_dir, tag=tag)


def retained_root(path: Path, retained: Iterable[Path]) -> Path | None:
    """The retained root that ``path`` really lies under (after resolving symlinks), if any."""
    real = path.resolve()
    for root in retained:
        if real.is_relative_to(root.resolve()):
            return root
    return None


def file_md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(_MD5_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def assess(checkpoints_dir: Path, retained: Sequence[Path], remote: RemoteStore | None) -> Verdict:
    """Is the latest checkpoint under ``checkpoints_dir`` safe from a release of the workers?"""
    latest = find_latest_checkpoint(checkpoints_dir)
    if latest is None:
        return Verdict(True, f"no checkpoint under {checkpoints_dir}: nothing to lose")
    files = (
        sorted(path for path in latest.tag_dir.rglob("*") if path.is_file())
        if latest.tag_dir.is_dir()
        else []
    )
    if not files:
        return Verdict(
            False,
            f"{latest.run_dir / 'latest'} names {latest.tag}, but {latest.tag_dir} "
            "is missing or empty",
        )
    root = retained_root(latest.tag_dir, retained)
    if root is not None:
        return Verdict(True, f"latest checkpoint {latest} is on retained storage ({root})")
    # Checked after the retained roots: hashing a multi-GB checkpoint is the expensive path.
    if remote is not None:
        missing = [path for path in files if not remote.has(file_md5(path))]
        if not missing:
            return Verdict(True, f"latest checkpoint {latest} is in the {remote.description}")
        where = f"{len(missing)} of its {len(files)} files are not in the {remote.description}"
    else:
        where = "no DVC remote is configured"
    shown = ", ".join(str(root) for root in retained) or "none given"
    return Verdict(
        False,
        f"latest checkpoint {latest} ({latest.tag_dir}) is not on retained storage "
        f"({shown}) and {where}",
    )


class UnknownRemote:
    """Stands for a remote that could not be looked up; consulted (the checkpoint is not on retained
    storage), it makes the guard refuse with the reason."""

    def __init__(self, reason: str):
        self.description = "DVC remote"
        self.reason = reason

    def has(self, md5: str) -> bool:
        raise GuardError(self.reason)


def dvc_remote_url(repo: Path, dvc: str | None = None) -> str | None:
    """The default remote's URL as DVC resolves it from the repository's, local, global and system
    config (a relative path comes back absolute); None when no default remote is set."""
    dvc = dvc or dvc_command()
    name = _dvc_config(repo, dvc, "core.remote")
    return _dvc_config(repo, dvc, f"remote.{name}.url") if name else None


def _dvc_config(repo: Path, dvc: str, key: str) -> str | None:
    try:
        done = subprocess.run(
            [dvc, "config", key], cwd=repo, capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        raise GuardError(
            f"cannot look up the DVC remote: the dvc command ({dvc}) is not installed"
        ) from None
    if done.returncode != 0:
        first_line = (done.stderr.strip().splitlines() or ["no message"])[0]
        raise GuardError(f"cannot read the DVC config of {repo}: {first_line}")
    return done.stdout.strip() or None


def open_remote(url: str) -> RemoteStore:
    """A local directory remote is checked on disk; any other URL through `dvc ls-url`."""
    if url.startswith("file://"):
        return LocalDvcRemote(Path(url[len("file://") :]))
    if "://" in url or re.match(r"^[\w.-]+@[\w.-]+:", url):
        return ListedDvcRemote(url)
    return LocalDvcRemote(Path(url).expanduser())


def find_remote(args: argparse.Namespace) -> RemoteStore | None:
    """--dvc-remote, else the repository's default remote; a failed look-up counts only if the
    remote is needed."""
    try:
        url = args.dvc_remote if args.dvc_remote else dvc_remote_url(args.dvc_repo)
    except GuardError as error:
        return UnknownRemote(str(error))
    return open_remote(url) if url else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="teardown_guard", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoints",
        type=Path,
        default=Path("checkpoints"),
        help="directory holding run-<12 hex>/ checkpoint runs (default: checkpoints)",
    )
    parser.add_argument(
        "--retained",
        type=Path,
        action="append",
        help=f"a directory on retained storage; repeatable (default: {DEFAULT_RETAINED})",
    )
    parser.add_argument(
        "--dvc-repo",
        type=Path,
        default=Path("."),
        help="DVC repository whose default remote counts as durable (default: .)",
    )
    parser.add_argument(
        "--dvc-remote", help="remote URL or directory, instead of the repository's default"
    )
    parser.add_argument(
        "--force", action="store_true", help="release even when the checkpoint could be lost"
    )
    args = parser.parse_args(argv)

    retained = args.retained if args.retained is not None else [Path(DEFAULT_RETAINED)]
    try:
        verdict = assess(args.checkpoints, retained, find_remote(args))
    except GuardError as error:
        verdict = Verdict(False, str(error))
    if verdict.safe:
        print(f"teardown guard: ok, {verdict.reason}")
        return 0
    if args.force:
        print(
            f"teardown guard: FORCE=1, releasing anyway although {verdict.reason}", file=sys.stderr
        )
        return 0
    print(
        f"teardown guard: refusing to release the GPUs: {verdict.reason}.\n"
        "  Push it first (`dvc commit` if needed, then `dvc push`), or keep checkpoints on the retained\n"
        "  volume, or run `make down FORCE=1` to release anyway and lose it.",
        file=sys.stderr,
    )
    return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
