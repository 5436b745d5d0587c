"""Where a run lives for `fab status`, `fetch` and `tensorboard`: its hosts or its store.

Where a run lives, for `fab status`, `fab fetch` and `fab tensorboard`: on the hosts it was
launched on, read over SSH (HostRun), or in its run store (storage.remote), which outlives them
(StoredRun: `--launch ID` without a host, `--from-store`). Those three tasks are written once, over
RunSource (clipforge.launcher.watch, clipforge.launcher.fetch); this module knows how each place
answers them.

The store is reached from this machine, with its credentials (the library's usual environment
or profile); `fab train` recorded each launch there (launches/<run>.json), which names the
training run whose files the store keeps (clipforge.store.remote).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import posixpath
import subprocess
import sys
import tarfile
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from decimal import Decimal
from pathlib import Path

from clipforge.errors import LauncherError
from clipforge.fsutil import join_inside
from clipforge.ids import checked_launch_id, parse_run_id
from clipforge.launcher import recovery
from clipforge.launcher.commands import docker_cleanup_argv, docker_run_argv
from clipforge.launcher.connection import forward_local, join, probe, q, run
from clipforge.launcher.host import status as status_mod
from clipforge.launcher.host.record import RunRecord, record_from_dict
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.state import RunState, StateFileError, state_from_dict
from clipforge.launcher.session import (
    Host,
    Settings,
    later_container,
    node_layout,
    read_remote_record,
    remote_python,
)
from clipforge.launcher.stack import StackOutputs
from clipforge.repro.experiments import (
    experiment_name,
    fetch_experiment_bundle,
    newest_experiment,
)
from clipforge.store.remote import RunStore, read_launch
from clipforge.store.sync_state import (
    STORE_STATUS_FILE,
    SyncPhase,
    SyncState,
    SyncStateError,
    parse_sync_state,
    sync_state_from_dict,
)
from clipforge.util import format_duration, short_repr, wait_script, wait_until_answering

Say = Callable[[str], None]
Row = tuple[str, str]
# A running TensorBoard: whether it still serves (the task stops waiting when it no longer does).
Serving = Callable[[], bool]

RESULTS = ("metrics", "models/clip", "logs")  # inside the DVC workspace, written by rank 0
TENSORBOARD_START_SECONDS = 120.0


class RunSource(ABC):
    """A place that holds a run: what `fab status`, `fab fetch` and `fab tensorboard` ask of it."""

    launch_id: str
    where: str
    """The place, as the status table's heading names it (`WHERE  launch RUN`)."""
    origin: str | None
    """What `fab fetch` says it fetched from (None: nothing, the hosts being the default)."""

    @abstractmethod
    def record(self) -> RunRecord:
        """The launch's run record; LauncherError when there is none or it is damaged."""

    @abstractmethod
    def sync_state(self) -> tuple[SyncState | None, str | None]:
        """The run store uploader's last word (None: none yet), or what is wrong with it."""

    @abstractmethod
    def last_row(self) -> dict:
        """The last row of this launch's own training in metrics/train.tsv ({}: none yet)."""

    @abstractmethod
    def recovery_text(self) -> tuple[str, str] | None:
        """The recovery controller's record here and a name for it (None: no controller)."""

    @abstractmethod
    def status_rows(self, price_per_gpu_hour: Decimal | None) -> list[Row]:
        """What this place knows of where the run stands, as (label, value) rows."""

    def more_status_lines(self) -> list[str]:
        """Lines after the table (one per further node of a multi-node run)."""
        return []

    @abstractmethod
    def run_state(self) -> RunState | None:
        """Where the run stands as this place knows it (None: it has not said yet)."""

    def refresh(self) -> None:  # noqa: B027 (a place that caches nothing has nothing to forget)
        """Forget what was read, so that the next answers are read again (`fab status --watch`)."""

    @abstractmethod
    def copy_outputs(self, into: Path, say: Say) -> None:
        """metrics/, models/clip/ and logs/ as the run wrote them, and this place's records of
        the run, into the folder `into`."""

    def fetch_experiment(self, repo: Path, say: Say) -> str | None:
        """The run's DVC experiment into `repo`'s experiment refs; its name, or None when this
        place holds none."""
        return None

    @abstractmethod
    def serving_logs(self, local_port: int, say: Say) -> AbstractContextManager[Serving]:
        """TensorBoard on the run's logs, answering at http://127.0.0.1:LOCAL_PORT/ inside the
        context, stopped after it."""

    def recovery_rows(self) -> list[Row]:
        """The recovery controller's rows (`fab train --spare`): its state and the run's moves,
        as its record here has them; none for a run without a controller."""
        found = self.recovery_text()
        if found is None:
            return []
        text, source = found
        try:
            return recovery.status_rows(recovery.parse_record(text, source))
        except recovery.RecordError as exc:
            return [("recovery", f"unreadable: {exc}")]


# -- on its hosts --------------------------------------------------------------------------------
def node_status(host: Host, layout: NodeLayout, settings: Settings) -> dict:
    """The node's status as the host side reads it (clipforge.launcher.host.status)."""
    result = run(
        host.cxn,
        remote_python(settings, layout, "status", layout.node_dir),
        what="reading the run's status",
    )
    return json.loads(result.stdout)


class HostRun(RunSource):
    """The run on the hosts it was launched on, a node per host (node rank: position)."""

    def __init__(
        self,
        nodes: list[tuple[Host, NodeLayout]],
        settings: Settings,
        stack: StackOutputs | None = None,
    ):
        self.nodes, self.settings = nodes, settings
        self.host, self.layout = nodes[0]
        self.launch_id = self.layout.launch_id
        self.where, self.origin = self.host.label, None
        self.stack_price = stack.price_per_gpu_hour if stack else None

    @classmethod
    def on(
        cls,
        hosts: list[Host],
        launch_id: str | None,
        settings: Settings,
        stack: StackOutputs | None = None,
    ) -> HostRun:
        """Launch `launch_id` (None: the newest) on `hosts`, in the order it was launched on."""
        nodes = [(host, node_layout(host, index, launch_id)) for index, host in enumerate(hosts)]
        return cls(nodes, settings, stack)

    @functools.cached_property
    def _status(self) -> dict:
        return node_status(self.host, self.layout, self.settings)

    def record(self) -> RunRecord:
        return read_remote_record(self.host, self.layout)

    def sync_state(self) -> tuple[SyncState | None, str | None]:
        raw = self._status.get("sync")
        if raw:
            source = f"{self.host.label}: the run store's sync state"
            return sync_state_from_dict(raw, source), None
        return None, self._status.get("sync_error")

    def last_row(self) -> dict:
        return self._status.get("last_row") or {}

    def run_state(self) -> RunState | None:
        try:  # the host side reads it (a damaged one: {} and its error, as the rows say)
            return state_from_dict(self._status["state"]).state if self._status["state"] else None
        except StateFileError:
            return None

    def refresh(self) -> None:
        self.__dict__.pop("_status", None)  # the cached_property's value

    def recovery_text(self) -> tuple[str, str] | None:
        path = posixpath.join(self.layout.run_dir, recovery.RECOVERY_FILE)
        result = probe(self.host.cxn, f"cat {q(path)}")
        if not result.ok or not result.stdout.strip():
            return None
        return result.stdout, f"{self.host.label}:{path}"

    def status_rows(self, price_per_gpu_hour: Decimal | None) -> list[Row]:
        """Node 0's status; the cost at `price_per_gpu_hour`, else at the stack's price."""
        price = price_per_gpu_hour if price_per_gpu_hour is not None else self.stack_price
        return status_mod.summarize(self._status, price)

    def more_status_lines(self) -> list[str]:
        lines = []
        for host, layout in self.nodes[1:]:
            state = node_status(host, layout, self.settings)["state"]
            lines.append(
                f"{host.label}  node {layout.node_rank}: {state.get('state')}, "
                f"restarts {state.get('restarts', 0)}"
            )
        return lines

    def copy_outputs(self, into: Path, say: Say) -> None:
        """Node 0's results, and node-<rank>/ with each node's records and logs."""
        for host, layout in self.nodes:
            picks = [
                (path, f"node-{layout.node_rank}/{posixpath.basename(path)}")
                for path in _node_files(layout)
            ]
            if layout.node_rank == 0:
                picks += [(layout.output(name), name) for name in RESULTS]
            _copy_home(host, picks, into)
        if not (into / "metrics").is_dir():
            say(f"note: no metrics yet for {self.launch_id} (the run has not logged a step)")
        elif not (into / "metrics" / "eval.json").is_file():
            say(
                f"note: no metrics/eval.json yet for {self.launch_id} (its eval phase has not "
                "finished)"
            )

    def fetch_experiment(self, repo: Path, say: Say) -> str | None:
        """The newest DVC experiment of node 0's checkout (a run through DVC: the eval phase's,
        with every stage's params and metrics), as a git bundle based on the launched commit,
        which `repo` holds, named there by the launch id (and `-smoke`: experiment_name) instead
        of DVC's random name. None when the run made none (several nodes, mounted data: no
        DVC)."""
        host, layout = self.host, self.layout
        code = q(layout.code)
        refs = probe(
            host.cxn,
            f"git -C {code} for-each-ref --sort=-creatordate --format='%(refname)' refs/exps",
        )
        ref = newest_experiment(refs.stdout) if refs.ok else None
        if ref is None:
            return None
        record = self.record()
        remote_bundle = run(
            host.cxn,
            f'b=$(mktemp /tmp/clipforge-exp.XXXXXX) && git -C {code} bundle create "$b" '
            f'{q(ref)} ^{q(record.commit)} && echo "$b"',
            what="bundling the run's DVC experiment",
        ).stdout.strip()
        name = experiment_name(layout.launch_id, record.smoke)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                local = Path(tmp) / "experiment.bundle"
                host.cxn.get(remote_bundle, str(local))
                fetch_experiment_bundle(repo, local, ref, name)
        finally:
            probe(host.cxn, f"rm -f {q(remote_bundle)}")
        say(f"experiment {name}: `dvc exp show` lists it beside the others")
        return name

    @contextlib.contextmanager
    def serving_logs(self, local_port: int, say: Say) -> Iterator[Serving]:
        """TensorBoard on node 0's host (in the run's image for a docker run), reached through
        an SSH port-forward."""
        host, layout, settings = self.host, self.layout, self.settings
        record = self.record()
        free = run(
            host.cxn,
            f"{q(settings.python)} -c 'import socket; s=socket.socket(); "
            f's.bind(("127.0.0.1", 0)); print(s.getsockname()[1])\'',
            what="finding a free port",
        ).stdout.strip()
        remote_port = int(free)
        logdir = layout.output("logs")
        serve = ["--logdir", logdir, "--host", "127.0.0.1", "--port", str(remote_port)]
        if record.runtime == "docker":
            spec = later_container(
                host, layout, record, settings, "tensorboard", read_only=True, detach=True
            )
            start = join(docker_run_argv(spec, ["tensorboard", *serve]))
            stop_cmd = join(docker_cleanup_argv(spec.name))
        else:
            pid_file = layout.tensorboard_pid
            start = (
                f"setsid nohup {join([settings.python, '-m', 'tensorboard.main', *serve])} > "
                f"{q(layout.tensorboard_log)} 2>&1 < /dev/null & echo $! > {q(pid_file)}"
            )
            # setsid made TensorBoard a process group leader: its data server goes with it.
            stop_cmd = f"kill -- -$(cat {q(pid_file)}) && rm -f {q(pid_file)}"
        run(host.cxn, f"mkdir -p {q(logdir)}", what="creating the logs directory")
        run(host.cxn, start, what="starting TensorBoard")
        try:
            script = wait_script(f"http://127.0.0.1:{remote_port}/", TENSORBOARD_START_SECONDS)
            run(
                host.cxn,
                f"{q(settings.python)} -c {q(script)}",
                what="waiting for TensorBoard to answer",
            )
            with forward_local(host.cxn, local_port, remote_port):
                yield lambda: True
        finally:
            probe(host.cxn, stop_cmd)


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
                members = _checked_members(archive, into, f"{host.label}: the run's results")
                if hasattr(tarfile, "data_filter"):  # the standard library's checks on top
                    archive.extractall(into, members=members, filter="data")
                else:  # a Python before 3.10.12 / 3.11.4
                    archive.extractall(into, members=members)
    finally:
        probe(host.cxn, f"rm -f {q(remote_tar)}")


def _checked_members(archive: tarfile.TarFile, into: Path, source: str) -> list[tarfile.TarInfo]:
    """The archive's files and folders, each named as `into` will hold it, once every name stays
    inside `into` (fsutil.join_inside). The host packs with `tar -h`, so a link, a device or a
    fifo is something else's doing: refused with the rest, before anything is extracted."""
    members = []
    for member in archive.getmembers():
        name = member.name.removeprefix("./")
        if name in (".", "") and member.isdir():
            continue  # the archive's own top folder: `into`
        if not (member.isfile() or member.isdir()):
            raise LauncherError(
                f"{source} holds {short_repr(member.name)}, which is not a file or a folder (a link "
                "or a device); nothing was written"
            )
        join_inside(into, name, source)
        member.name = name
        members.append(member)
    return members


# -- in its run store ----------------------------------------------------------------------------
class StoredRun(RunSource):
    """The run as its run store keeps it: what the uploader last sent, whatever became of the
    hosts. `downloads`: where `fab tensorboard` puts the logs it serves (downloads/RUN/logs)."""

    def __init__(self, store: RunStore, record: RunRecord, downloads: Path = Path("runs")):
        self.store, self._record, self.downloads = store, record, downloads
        self.launch_id = record.launch_id
        self.where, self.origin = "run store", store.url

    @classmethod
    def open(
        cls, remote: str | None, launch_id: str | None, downloads: Path = Path("runs")
    ) -> StoredRun:
        """Launch `launch_id` in the store `remote`, by its record there (its run.json as the
        train stage copied it, clipforge.launcher.host.record's reader)."""
        if not launch_id:
            raise LauncherError("--launch ID: which launch to read from the run store")
        launch_id = checked_launch_id(launch_id, "--launch")
        if not remote:
            raise LauncherError(
                "no run store to read from: pass --store URL, or set storage.remote in params.yaml"
            )
        try:
            launch = read_launch(remote, launch_id)
        except Exception as exc:  # any library's error (no credentials, unreachable): one line
            raise LauncherError(f"run store {remote}: {exc}") from None
        if launch is None:
            raise LauncherError(
                f"the run store {remote} has no run {launch_id} (no launches/{launch_id}.json)"
            )
        source = f"{remote} launches/{launch_id}.json"
        # Both ids name folders here and in the store: whoever writes the store chooses them.
        training_run = launch.get("training_run")
        parse_run_id(training_run, f"{source}: training_run")
        record = record_from_dict(launch, source)  # RunRecordError (a UserError) when damaged
        if record.launch_id != launch_id:
            raise LauncherError(
                f"{source}: names the launch {short_repr(record.launch_id)}, not {launch_id}; "
                "nothing was read from it"
            )
        try:
            store = RunStore(remote, str(training_run))
        except Exception as exc:  # as above
            raise LauncherError(f"run store {remote}: {exc}") from None
        return cls(store, record, downloads)

    def record(self) -> RunRecord:
        return self._record

    def sync_state(self) -> tuple[SyncState | None, str | None]:
        try:
            text = self.store.fs.cat_file(self.store.path(STORE_STATUS_FILE))
        except FileNotFoundError:
            return None, None
        try:
            return parse_sync_state(text, f"{self.store.url}/{STORE_STATUS_FILE}"), None
        except SyncStateError as exc:
            return None, str(exc)

    def run_state(self) -> RunState | None:
        """The uploader's last word: training (running), or the train stage's outcome."""
        status, _ = self.sync_state()
        if status is None:
            return None
        return (
            RunState.RUNNING if status.state is SyncPhase.TRAINING else RunState(status.state.value)
        )

    def last_row(self) -> dict:
        try:
            text = self.store.fs.cat_file(self.store.path("metrics/train.tsv")).decode("utf-8")
        except FileNotFoundError:
            return {}
        rows = csv.DictReader(io.StringIO(text), delimiter="\t")
        own = [r for r in rows if r.get("run_id") == self.store.run_id]
        return own[-1] if own else {}

    def recovery_text(self) -> tuple[str, str] | None:
        store = self.store
        path = posixpath.join(
            posixpath.dirname(store.root), recovery.store_record_path(self.launch_id)
        )
        try:
            return store.fs.cat_file(path).decode("utf-8"), f"{store.remote}: {path}"
        except FileNotFoundError:
            return None

    def status_rows(self, price_per_gpu_hour: Decimal | None) -> list[Row]:
        """State, host, step, loss and sync lag as the store last heard of them (no cost: the
        store does not know the GPU hours)."""
        status, status_error = self.sync_state()
        row = self.last_row()
        if status:
            ago = format_duration(time.time() - status.updated_at)
            state = f"{status.state} on {status.host}, as of {ago} ago"
            synced = status_mod.sync_text(status)
        else:
            state = f"unknown: {status_error}" if status_error else "unknown"
            synced = "-" if status_error else "no status written yet"
        return [
            ("launch", f"{self.launch_id} (commit {self._record.commit[:10]}, {self.store.url})"),
            ("run", self.store.run_id),
            ("state", state),
            ("step", row.get("step", "-")),
            ("loss", row.get("loss", "-")),
            ("run store", synced),
        ]

    def copy_outputs(self, into: Path, say: Say) -> None:
        """The results as the store has them, and its record and status of the run (store/)."""
        self.store.download_trees({prefix: into / prefix for prefix in RESULTS})
        for name in ("record.json", STORE_STATUS_FILE):
            self.store.download_file(name, into / "store" / name)

    @contextlib.contextmanager
    def serving_logs(self, local_port: int, say: Say) -> Iterator[Serving]:
        """The run's TensorBoard events downloaded into downloads/RUN/logs, served by a
        TensorBoard here."""
        logdir = join_inside(self.downloads, f"{self.launch_id}/logs", "the launch id")
        count = self.store.download_trees({"logs": logdir})
        say(f"{count} log files of {self.launch_id} from {self.store.url} in {logdir}")
        argv = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
        log = logdir.parent / "tensorboard.log"
        with open(log, "wb") as output:
            server = subprocess.Popen(
                [*argv, "--host", "127.0.0.1", "--port", str(local_port)],
                stdout=output,
                stderr=output,
            )
        url = f"http://127.0.0.1:{local_port}/"
        try:
            if not wait_until_answering(
                url, TENSORBOARD_START_SECONDS, alive=lambda: server.poll() is None
            ):
                if server.poll() is not None:
                    raise LauncherError(
                        f"TensorBoard exited: {log.read_text(errors='replace')[-2000:]}"
                    )
                raise LauncherError(f"TensorBoard did not answer at {url}")
            yield lambda: server.poll() is None
        finally:
            server.terminate()
            server.wait()
