"""`fab fetch`: bring a run's results home, or push them to the DVC remote.

Bring a run's results home, from where it lives (clipforge.launcher.run_source),
or push them to the DVC remote from the host.

Home: runs/<run id>/ under the project (gitignored) with metrics/ (the eval stage's eval.json and
eval.info.json among them), models/clip/ and logs/ as the stages wrote them on node 0, and
node-<rank>/ with each node's record, state and train.log; from the run store, its copies of
metrics/, models/clip/ and logs/, and store/ with its record and status of the run. The copy
lands in a temporary directory first and replaces the previous one whole.

A run through DVC (one node) is also a DVC experiment of the launched commit: its git ref comes
home into the local repository's experiments, named by the launch id (`<launch id>-smoke` for a
smoke run), so `dvc exp show` lists it beside the demo and every other run, with its params and
metrics, under the name `fab runs` gives it; fetched again, it replaces itself.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from pathlib import Path

from clipforge.errors import LauncherError
from clipforge.fsutil import join_inside, replace_dir_atomically
from clipforge.launcher.commands import IMAGE_PYTHON, docker_run_argv
from clipforge.launcher.connection import join, q, run
from clipforge.launcher.run_source import HostRun, RunSource
from clipforge.launcher.session import Settings, later_container, read_remote_record


def fetch(source: RunSource, destination: Path, repo: Path, say: Callable[[str], None]) -> Path:
    """The run's outputs into destination/<launch id>/, replaced whole; then its DVC experiment,
    if the place holds one, into the experiments of the git repository `repo`."""
    target = join_inside(destination, source.launch_id, f"{source.where}: the launch id")
    with replace_dir_atomically(target) as tmp:
        source.copy_outputs(tmp, say)
    origin = f" from {source.origin}" if source.origin else ""
    say(f"fetched {source.launch_id}{origin} into {target}")
    source.fetch_experiment(repo, say)
    return target


def push(source: RunSource, settings: Settings, say: Callable[[str], None]) -> None:
    """`dvc push` in the run's workspace on node 0's host: the exported model (and data) go to
    the DVC remote configured in the commit, where a later `dvc pull` anywhere finds them."""
    if not isinstance(source, HostRun):
        raise LauncherError(
            "--push runs `dvc push` on the run's host: give its hosts (-H), not the run store"
        )
    host, layout = source.host, source.layout
    record = read_remote_record(host, layout)
    if record.runtime == "docker":
        spec = later_container(host, layout, record, settings, "push")
        command = join(docker_run_argv(spec, [IMAGE_PYTHON, "-m", "dvc", "push"]))
    else:
        bin_dir = posixpath.dirname(settings.python)
        path = f'PATH={q(bin_dir)}:"$PATH" ' if bin_dir else ""
        command = f"{path}{q(settings.python)} -m dvc push"
    result = run(host.cxn, f"cd {q(layout.code)} && {command}", what="dvc push on the host")
    say(result.stdout.strip() or "dvc push: done")
