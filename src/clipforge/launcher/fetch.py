"""`fab fetch`: bring a run's results home, or push them to the DVC remote from the host.

Home: runs/<run id>/ under the project (gitignored) with metrics/ (the eval stage's eval.json and
eval.info.json among them), models/clip/ and logs/ as the stages wrote them on node 0, and
node-<rank>/ with each node's record, state and train.log. The copy lands in a temporary
directory first and replaces the previous one whole.

A run through DVC (one node) is also a DVC experiment of the launched commit: its git ref comes
home into the local repository's experiments, so `dvc exp show` lists it beside the demo and
every other run, with its params and metrics.
"""

from __future__ import annotations

import posixpath
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from clipforge.fsutil import replace_dir_atomically
from clipforge.launcher import LauncherError
from clipforge.launcher.commands import IMAGE_PYTHON, docker_run_argv
from clipforge.launcher.connection import join, probe, q, run
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.session import Host, Settings, later_container, read_remote_record

RESULTS = ("metrics", "models/clip", "logs")  # inside the DVC workspace, written by rank 0


def _node_files(layout: NodeLayout) -> tuple[str, ...]:
    """The node's record, state and logs, and the run's record and params."""
    return (
        layout.train_log,
        layout.supervisor_log,
        layout.state,
        layout.plan,
        layout.smoke_result,
        layout.record,
        layout.resolved_params,
    )


def fetch(
    nodes: list[tuple[Host, NodeLayout]], destination: Path, say: Callable[[str], None]
) -> Path:
    launch_id = nodes[0][1].launch_id
    target = destination / launch_id
    with replace_dir_atomically(target) as tmp:
        for host, layout in nodes:
            picks = [
                (path, f"node-{layout.node_rank}/{posixpath.basename(path)}")
                for path in _node_files(layout)
            ]
            if layout.node_rank == 0:
                picks += [(layout.output(name), name) for name in RESULTS]
            _copy_home(host, picks, tmp)
        if not (tmp / "metrics").is_dir():
            say(f"note: no metrics yet for {launch_id} (the run has not logged a step)")
        elif not (tmp / "metrics" / "eval.json").is_file():
            say(f"note: no metrics/eval.json yet for {launch_id} (its eval phase has not finished)")
    say(f"fetched {launch_id} into {target}")
    return target


# DVC's own refs under refs/exps that are no experiment: its executors' and queue's bookkeeping.
_NOT_EXPERIMENTS = ("refs/exps/exec/", "refs/exps/celery/", "refs/exps/temp/")


def newest_experiment(refs: str) -> str | None:
    """The newest experiment among `git for-each-ref --sort=-creatordate` lines."""
    for ref in refs.split():
        if ref.startswith("refs/exps/") and not ref.startswith(_NOT_EXPERIMENTS):
            return ref
    return None


def fetch_experiment(host: Host, layout: NodeLayout, repo: Path, say: Callable[[str], None]):
    """The run's newest DVC experiment (the eval phase's: every stage's params and metrics) into
    `repo`'s experiment refs, as a git bundle based on the launched commit, which `repo` holds.
    None when the run made none (several nodes, mounted data: no DVC)."""
    code = q(layout.code)
    refs = probe(
        host.cxn, f"git -C {code} for-each-ref --sort=-creatordate --format='%(refname)' refs/exps"
    )
    ref = newest_experiment(refs.stdout) if refs.ok else None
    if ref is None:
        return None
    record = read_remote_record(host, layout)
    remote_bundle = run(
        host.cxn,
        f'b=$(mktemp /tmp/clipforge-exp.XXXXXX) && git -C {code} bundle create "$b" '
        f'{q(ref)} ^{q(record.commit)} && echo "$b"',
        what="bundling the run's DVC experiment",
    ).stdout.strip()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "experiment.bundle"
            host.cxn.get(remote_bundle, str(local))
            fetched = subprocess.run(
                ["git", "fetch", "--quiet", str(local), f"+{ref}:{ref}"],
                cwd=repo,
                capture_output=True,
                text=True,
            )
    finally:
        probe(host.cxn, f"rm -f {q(remote_bundle)}")
    if fetched.returncode != 0:
        raise LauncherError(f"git fetch of the run's experiment failed: {fetched.stderr.strip()}")
    name = ref.rsplit("/", 1)[-1]
    say(f"experiment {name} of {layout.launch_id}: `dvc exp show` lists it beside the others")
    return name


def _copy_home(host: Host, picks: list[tuple[str, str]], into: Path) -> None:
    """Pack what exists into one tarball on the host (symlinks to the picks, followed), copy it
    over SFTP, unpack it here."""
    links = " ".join(
        f'if [ -e {q(src)} ]; then mkdir -p "$stage"/{q(posixpath.dirname(dst) or ".")} '
        f'&& ln -s {q(src)} "$stage"/{q(dst)}; fi;'
        for src, dst in picks
    )
    script = (
        f"set -e; stage=$(mktemp -d /tmp/clipforge-fetch.XXXXXX); {links} "
        f'tar -chzf "$stage.tgz" -C "$stage" . && rm -rf "$stage" && echo "$stage.tgz"'
    )
    remote_tar = run(host.cxn, script, what="packing the run's results").stdout.strip()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local_tar = Path(tmp) / "results.tgz"
            host.cxn.get(remote_tar, str(local_tar))
            with tarfile.open(local_tar) as archive:
                if hasattr(tarfile, "data_filter"):
                    archive.extractall(into, filter="data")
                else:  # Python without extraction filters: refuse anything that escapes
                    for member in archive.getmembers():
                        if (
                            member.name.startswith("/")
                            or ".." in Path(member.name).parts
                            or member.issym()
                            or member.islnk()
                        ):
                            raise LauncherError(
                                f"unsafe path in the results archive: {member.name}"
                            )
                    archive.extractall(into)
    finally:
        probe(host.cxn, f"rm -f {q(remote_tar)}")


def push(host: Host, layout: NodeLayout, settings: Settings, say: Callable[[str], None]) -> None:
    """`dvc push` in the run's workspace on the host: the exported model (and data) go to the DVC
    remote configured in the commit, where a later `dvc pull` anywhere finds them."""
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
