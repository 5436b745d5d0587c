"""The code a run ships: the current commit of the local git repository, as a git bundle.

A bundle (not `git archive`) because the host needs a real repository: DVC's experiments work on
git commits, and the run record keeps the commit id the host checked out.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from clipforge.launcher import LauncherError


@dataclass(frozen=True)
class Source:
    root: Path
    commit: str
    dirty: list[str]  # `git status --porcelain` lines: what the run will NOT contain

    def show(self, path: str) -> str | None:
        """A file's text at the commit (None when the commit has no such file)."""
        result = _git(self.root, "show", f"{self.commit}:{path}", check=False)
        return result.stdout if result.returncode == 0 else None


def current_source(start: Path) -> Source:
    top = _git(start, "rev-parse", "--show-toplevel", check=False)
    if top.returncode != 0:
        raise LauncherError(
            f"{start}: not inside a git repository; run fab from a clone of the project"
        )
    root = Path(top.stdout.strip())
    head = _git(root, "rev-parse", "--verify", "HEAD", check=False)
    if head.returncode != 0:
        raise LauncherError(f"{root}: no commit yet; commit the code to ship it")
    status = _git(root, "status", "--porcelain", "--untracked-files=normal")
    return Source(root=root, commit=head.stdout.strip(), dirty=status.stdout.splitlines())


def require_clean(source: Source, allow_dirty: bool) -> None:
    if source.dirty and not allow_dirty:
        shown = "\n  ".join(source.dirty[:10]) + ("\n  ..." if len(source.dirty) > 10 else "")
        raise LauncherError(
            f"the working tree has changes that are not committed:\n  {shown}\n"
            f"a run ships commit {source.commit[:10]} only: commit (or stash) them, or "
            f"pass --allow-dirty to ship the commit without them"
        )


def write_bundle(source: Source, path: Path) -> None:
    """HEAD and the source's commit (another one when a run moves to a new host): the clone on
    the host unpacks every object of the bundle, so the commit can be checked out there."""
    _git(source.root, "bundle", "create", str(path), "HEAD", source.commit)


def source_at(start: Path, commit: str) -> Source:
    """The local repository at `commit` (that of an earlier launch), which it must hold."""
    root = current_source(start).root
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode != 0:
        raise LauncherError(
            f"{root}: commit {commit[:10]} is not in this repository; `git fetch` the branch "
            f"that holds it, then try again"
        )
    return Source(root=root, commit=commit, dirty=[])


def _git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise LauncherError("git is not installed here; the launcher ships code with git") from None
    if check and result.returncode != 0:
        raise LauncherError(f"git {' '.join(args)} failed: {result.stderr.strip()}")
    return result
