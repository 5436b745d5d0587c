"""The code a run ships: the current commit of the local git repository, as a git bundle.

A bundle (not `git archive`) because the host needs a real repository: DVC's experiments work on
git commits, and the run record keeps the commit id the host checked out.
"""

from __future__ import annotations

import posixpath
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from clipforge.errors import LauncherError

# Never uncommitted changes of the code a run ships: what DVC writes beside the outputs declared in
# dvc.yaml (its lock), and fab's own local settings (Fabric reads fabric.yaml on the laptop only;
# the host never sees it). The run rebuilds every result from the commit, so the README's
# `make demo`, `dvc exp apply` and a fabric.yaml pointing at the host's Python leave the tree
# shippable, and the run record still names one commit.
NEVER_DIRTY = ("dvc.lock", "fabric.yaml", "fabric.yml")


@dataclass(frozen=True)
class Source:
    root: Path
    commit: str
    dirty: list[str]  # `git status --porcelain` lines: what the run will NOT contain
    # Paths whose changes are results or local settings, not code (see `uncommitted`).
    results: tuple[str, ...] = NEVER_DIRTY

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
    # Every untracked file, not its folder: metrics/ may hold a result and a new script.
    status = _git(root, "status", "--porcelain", "--untracked-files=all")
    commit = head.stdout.strip()
    dvc_yaml = _git(root, "show", f"{commit}:dvc.yaml", check=False)
    outputs = pipeline_outputs(dvc_yaml.stdout) if dvc_yaml.returncode == 0 else ()
    return Source(
        root=root, commit=commit, dirty=status.stdout.splitlines(), results=NEVER_DIRTY + outputs
    )


def pipeline_outputs(dvc_yaml: str) -> tuple[str, ...]:
    """The outs and metrics every stage of dvc.yaml declares (a `foreach` stage's with each item
    substituted), and the files its plots draw: what `dvc repro` and `dvc exp apply` write."""
    spec = yaml.safe_load(dvc_yaml) or {}
    paths: list[str] = []
    for stage in (spec.get("stages") or {}).values():
        body, items = stage, [None]
        if "foreach" in stage:
            body, items = stage.get("do") or {}, list(stage["foreach"])
        for key in ("outs", "metrics", "plots"):
            for entry in body.get(key) or []:
                name = next(iter(entry)) if isinstance(entry, dict) else entry
                for item in items:
                    paths.append(name if item is None else name.replace("${item}", str(item)))
    for plot in spec.get("plots") or []:
        y = (next(iter(plot.values())) or {}).get("y") if isinstance(plot, dict) else None
        paths += list(y) if isinstance(y, dict) else []
    return tuple(dict.fromkeys(posixpath.normpath(p) for p in paths))


def uncommitted(source: Source) -> list[str]:
    """The `git status --porcelain` lines of code changes: results of the pipeline (anything at
    or under a path in `source.results`) and fab's settings left out."""

    def is_result(line: str) -> bool:
        path = line[3:].split(" -> ")[-1].strip('"').rstrip("/")
        return any(path == r or path.startswith(r + "/") for r in source.results)

    return [line for line in source.dirty if not is_result(line)]


def require_clean(source: Source, allow_dirty: bool) -> None:
    dirty = uncommitted(source)
    if dirty and not allow_dirty:
        shown = "\n  ".join(dirty[:10]) + ("\n  ..." if len(dirty) > 10 else "")
        raise LauncherError(
            f"the working tree has changes that are not committed:\n  {shown}\n"
            f"a run ships commit {source.commit[:10]} only: commit (or stash) them, or "
            f"pass --allow-dirty to ship the commit without them (the pipeline's results, dvc.lock "
            f"and fabric.yaml never count)"
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
