"""A repository's DVC experiments: which git refs are ones, and what `dvc exp show` says of them.

clipforge.repro.runs reads what it says. `fab fetch` brings a run's experiment home as its git
ref (clipforge.launcher.run_source), and `fab runs` lists the experiments of every commit that
has some.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

# DVC's experiment refs, refs/exps/<baseline commit, split 2/38>/<name>; not its executors' and
# queue's bookkeeping there (refs/exps/exec/, celery/, temp/). The host lists them and the fetch
# writes that ref here, so nothing else may pass (`refs/heads/main`, a `:`, a `..`).
_EXPERIMENT_REF = re.compile(
    r"refs/exps/(?P<head>[0-9a-f]{2})/(?P<tail>[0-9a-f]{38})/[A-Za-z0-9][A-Za-z0-9_-]{0,99}"
)


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
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
        ).stdout.strip()
        for rev in ["HEAD", *(b for b in baselines if b != head)]:
            argv += ["--rev", rev]
    shown = subprocess.run(argv, cwd=repo, capture_output=True, text=True)
    if shown.returncode != 0:
        error = next((line for line in shown.stderr.splitlines() if line.strip()), "no message")
        return [], f"DVC's experiments left out: `dvc exp show` failed: {error}"
    return json.loads(shown.stdout), None
