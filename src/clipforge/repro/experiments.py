"""A repository's DVC experiments: which refs are ones, what `dvc exp show` says, their names.

clipforge.repro.runs reads what it says. `fab fetch` brings a run's experiment home as its git
ref (clipforge.launcher.run_source), named by the run's launch id (`-smoke` after a smoke run's)
rather than the random name DVC gave it on the host, and `fab runs` lists the experiments of every
commit that has some. `make demo` runs the pipeline as an experiment unless the workspace already
holds one, unchanged (`python -m clipforge.repro.experiments`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from clipforge.errors import UserError
from clipforge.ids import LAUNCH_ID

# DVC's experiment refs, refs/exps/<baseline commit, split 2/38>/<name>; not its executors' and
# queue's bookkeeping there (refs/exps/exec/, celery/, temp/). The host lists them and the fetch
# writes that ref here, so nothing else may pass (`refs/heads/main`, a `:`, a `..`).
_EXPERIMENT_REF = re.compile(
    r"refs/exps/(?P<head>[0-9a-f]{2})/(?P<tail>[0-9a-f]{38})/[A-Za-z0-9][A-Za-z0-9_-]{0,99}"
)


SMOKE_SUFFIX = "-smoke"  # a smoke run's experiment: `fab train --smoke` checked a host
_LAUNCH_EXPERIMENT = re.compile(rf"(?P<launch_id>{LAUNCH_ID.pattern})(?P<smoke>{SMOKE_SUFFIX})?")


class ExperimentError(UserError):
    """An experiment git would not take in; the message is git's."""


def experiment_name(launch_id: str, smoke: bool) -> str:
    """What a fetched run's experiment is called here: what `fab runs`, `fab fetch` and `fab
    status` call the run, so that `dvc exp show` and `dvc plots diff` take the same name."""
    return launch_id + SMOKE_SUFFIX if smoke else launch_id


def launch_of(name: str) -> tuple[str, bool] | None:
    """The launch id and smoke mark an experiment's name says (experiment_name's inverse); None
    for any other name (the demo's, `dvc exp run`'s)."""
    match = _LAUNCH_EXPERIMENT.fullmatch(name)
    return (match["launch_id"], bool(match["smoke"])) if match else None


def renamed(ref: str, name: str) -> str:
    """The experiment ref `ref` under another name, on the same baseline commit (what `dvc exp
    rename` writes: DVC reads an experiment's name from its ref only)."""
    match = _EXPERIMENT_REF.fullmatch(ref)
    if match is None or not _EXPERIMENT_REF.fullmatch(f"{ref.rsplit('/', 1)[0]}/{name}"):
        raise ValueError(f"no experiment ref or name: {ref!r}, {name!r}")
    return f"refs/exps/{match['head']}/{match['tail']}/{name}"


def fetch_experiment_bundle(repo: Path, bundle: Path, ref: str, name: str) -> str:
    """The experiment `ref` of a git bundle into `repo` as experiment `name`, replacing one of that
    name (the same run fetched again); the ref written."""
    local = renamed(ref, name)
    fetched = subprocess.run(
        ["git", "fetch", "--quiet", str(bundle), f"+{ref}:{local}"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    if fetched.returncode != 0:
        error = fetched.stderr.strip() or f"exit status {fetched.returncode}"
        raise ExperimentError(f"git fetch of the run's experiment failed: {error}")
    return local


def newest_experiment(refs: str) -> str | None:
    """The newest experiment among `git for-each-ref --sort=-creatordate` lines."""
    return next((ref for ref in refs.split() if _EXPERIMENT_REF.fullmatch(ref)), None)


def experiment_baselines(refs: str) -> list[str]:
    """The commits experiments are based on, among `git for-each-ref` lines, each once: what
    `dvc exp show --rev` takes to list experiments of commits other than HEAD."""
    found = (_EXPERIMENT_REF.fullmatch(ref) for ref in refs.split())
    return list(dict.fromkeys(m["head"] + m["tail"] for m in found if m))


def experiments_here(repo: Path) -> tuple[list, str | None]:
    """`dvc exp show --json` of every commit with experiments (DVC lists HEAD's only; -A reads
    every commit, minutes in a long history), and the reason when DVC could not list them.
    Nothing outside a DVC repository."""
    root = repo.resolve()
    if not any((p / ".dvc").is_dir() for p in (root, *root.parents)):
        return [], None
    refs = subprocess.run(
        ["git", "for-each-ref", "--format=%(refname)", "refs/exps"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    baselines = experiment_baselines(refs.stdout) if refs.returncode == 0 else []
    argv = [sys.executable, "-m", "dvc", "exp", "show", "--json"]
    if baselines:
        head = _git(repo, "rev-parse", "HEAD").strip()
        for rev in ["HEAD", *(b for b in baselines if b != head)]:
            argv += ["--rev", rev]
    shown = subprocess.run(argv, cwd=repo, capture_output=True, text=True)
    if shown.returncode != 0:
        error = next((line for line in shown.stderr.splitlines() if line.strip()), "no message")
        return [], f"DVC's experiments left out: `dvc exp show` failed: {error}"
    return json.loads(shown.stdout), None


def unchanged_experiment(repo: Path) -> str | None:
    """The experiment of HEAD that the workspace holds unchanged, newest first: DVC has nothing to
    reproduce (`dvc status`), and the workspace's dvc.lock, which records every stage's params
    and the hashes of its code, data and outputs, is that experiment's. None: `dvc exp run` would
    make something new (or nothing has run yet)."""
    lock = repo / "dvc.lock"
    if not lock.is_file():
        return None
    status = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"], cwd=repo, capture_output=True, text=True
    )
    if status.returncode != 0 or _parsed(status.stdout) != {}:
        return None
    head = _git(repo, "rev-parse", "HEAD").strip()
    refs = _git(
        repo,
        "for-each-ref",
        "--sort=-creatordate",
        "--format=%(refname)",
        f"refs/exps/{head[:2]}/{head[2:]}/",
    )
    text = lock.read_bytes()
    for ref in refs.split():
        recorded = subprocess.run(["git", "show", f"{ref}:dvc.lock"], cwd=repo, capture_output=True)
        if recorded.returncode == 0 and recorded.stdout == text:
            return ref.rsplit("/", 1)[-1]
    return None


def _parsed(text: str) -> object:
    """DVC's JSON; None for anything else (then the experiment runs, as `dvc exp run` decides)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True).stdout


def run_unless_unchanged(repo: Path, say: Callable[[str], None]) -> int:
    """`dvc exp run` in the workspace, unless it holds an experiment unchanged: `make demo` again
    with nothing changed adds no second row of the same numbers to `dvc exp show`. The exit
    status."""
    same = unchanged_experiment(repo)
    if same is not None:
        say(
            f"nothing changed since experiment {same} (params, code, data): not run again; "
            "`dvc exp run -f` runs it anyway"
        )
        return 0
    return subprocess.run([sys.executable, "-m", "dvc", "exp", "run"], cwd=repo).returncode


def main(argv: list[str] | None = None) -> int:
    """`python -m clipforge.repro.experiments`: what `make demo` runs (run_unless_unchanged)."""
    argparse.ArgumentParser(
        prog="python -m clipforge.repro.experiments", description=run_unless_unchanged.__doc__
    ).parse_args(argv)
    return run_unless_unchanged(Path("."), print)


if __name__ == "__main__":
    sys.exit(main())
