"""`fab fetch`: bring a run's results home, or push them to the DVC remote from the host.

Home: runs/<run id>/ under the project (gitignored) with metrics/, models/clip/ and logs/ as the
train stage wrote them on node 0, and node-<rank>/ with each node's record, state and train.log.
The copy lands in a temporary directory first and replaces the previous one whole.
"""

from __future__ import annotations

import posixpath
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from clipforge.fsutil import replace_dir_atomically
from clipforge.launcher import LauncherError
from clipforge.launcher.commands import IMAGE_PYTHON, docker_run_argv
from clipforge.launcher.connection import join, probe, q, run
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.session import Host, Settings, later_container, read_remote_json

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
    say(f"fetched {launch_id} into {target}")
    return target


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
    record = read_remote_json(host, layout.record) or {}
    if record.get("runtime") == "docker":
        spec = later_container(host, layout, record, settings, "push")
        command = join(docker_run_argv(spec, [IMAGE_PYTHON, "-m", "dvc", "push"]))
    else:
        bin_dir = posixpath.dirname(settings.python)
        path = f'PATH={q(bin_dir)}:"$PATH" ' if bin_dir else ""
        command = f"{path}{q(settings.python)} -m dvc push"
    result = run(host.cxn, f"cd {q(layout.code)} && {command}", what="dvc push on the host")
    say(result.stdout.strip() or "dvc push: done")
