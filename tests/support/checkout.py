"""The code under test, as `fab train` would ship it: this checkout's tracked files (as they are
in the working tree) and its new source files, never the results of the pipeline a user ran in it
(`dvc repro`, `make demo`, `dvc exp apply` leave metrics/, dvc.lock... untracked, and not all of
them ignored, since DVC asks for results to be committed)."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

import yaml

# DVC's own bookkeeping of a pipeline run: written by `dvc repro`/`dvc exp apply`, not a stage out.
DVC_RESULTS = ("dvc.lock", "dvc_plots")


def _paths(entries: Iterable) -> list[str]:
    """The paths of a dvc.yaml outs/metrics/plots list: each a path or a {path: options} map."""
    out = []
    for entry in entries or ():
        out += [entry] if isinstance(entry, str) else list(entry)
    return out


def _plot_paths(entries: Iterable) -> list[str]:
    """The files of the top-level `plots:` list: a path, or {id: {x:, y: {file: columns}}}."""
    out = []
    for entry in entries or ():
        if isinstance(entry, str):
            out.append(entry)
            continue
        for name, options in entry.items():
            axes = [options.get(axis) for axis in ("x", "y")] if isinstance(options, dict) else []
            files = [f for axis in axes if isinstance(axis, dict) for f in axis]
            out += files or [name]
    return out


def pipeline_outputs(dvc_yaml: str) -> list[str]:
    """Every path the pipeline of this dvc.yaml text writes, as glob patterns (a `foreach`
    stage's `${item}` matches anything): stage outs, metrics and plots, DVC's own results."""
    pipeline = yaml.safe_load(dvc_yaml) or {}
    paths = list(DVC_RESULTS) + _plot_paths(pipeline.get("plots"))
    for stage in (pipeline.get("stages") or {}).values():
        body = stage.get("do", stage)
        for key in ("outs", "metrics", "plots"):
            paths += _paths(body.get(key))
    return [re.sub(r"\$\{[^}]*\}", "*", path).rstrip("/") for path in paths]


def is_output(name: str, patterns: Iterable[str]) -> bool:
    """Whether the repository path `name` is one of the outputs, or inside one."""
    parts = name.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(p, pattern) for pattern in patterns for p in prefixes)


def _git_files(repo: Path, *selection: str) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", *selection], cwd=repo, capture_output=True, check=True
    ).stdout.split(b"\0")
    return [name.decode() for name in listed if name]


def shipped_files(repo: Path) -> list[str]:
    """The files of `repo` that are the code under test: every tracked file, and every untracked
    file git does not ignore unless the pipeline (dvc.yaml) writes it."""
    dvc_yaml = repo / "dvc.yaml"
    outputs = pipeline_outputs(dvc_yaml.read_text(encoding="utf-8")) if dvc_yaml.is_file() else []
    new = _git_files(repo, "--others", "--exclude-standard")
    files = _git_files(repo, "--cached") + [n for n in new if not is_output(n, outputs)]
    return sorted(n for n in set(files) if (repo / n).is_file())


def committed_text(repo: Path, name: str) -> str:
    """The file `name` as committed (HEAD), not as a command the README shows left it in the
    working tree (`dvc exp run -S train.lr=...` rewrites params.yaml); the working tree's copy
    where `repo` is no git checkout."""
    shown = subprocess.run(["git", "show", f"HEAD:{name}"], cwd=repo, capture_output=True)
    if shown.returncode != 0:
        return (repo / name).read_text(encoding="utf-8")
    return shown.stdout.decode("utf-8")


def copy_files(repo: Path, names: Iterable[str], root: Path) -> None:
    """Copy the named files of `repo` into `root`, with their permission bits."""
    for name in names:
        source, target = repo / name, root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
        target.chmod(source.stat().st_mode & 0o777)
