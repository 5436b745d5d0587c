"""Teardown guard: `make down` releases the stack's GPU workers only when no run on them would
lose its newest checkpoint.

`make down` runs it once the stack, the Pulumi CLI and the cluster are known good, with the
stack's outputs (`pulumi stack output`). Each worker is reached as `fab` reaches it (SSH with the
stack's pinned host key, through the port-forward or CLIPFORGE_SSH_GATEWAY) and lists the newest
checkpoint of every run on it (clipforge.launcher.host.stored_checkpoints, run by its python3).
Whether a checkpoint is safe is `checkpoint_safety`'s call, the one place of that rule: it lies
on retained storage (a volume the stack keeps across `make down`), or its run's store
(storage.remote, asked with this machine's credentials) holds it whole, or every file of it is in the
DVC remote (DVC 3 stores content by MD5 at ``<remote>/files/md5/<2 hex>/<30 hex>``, so no
dvc.lock entry is needed; the default remote is asked of DVC itself, so a remote set in the global
or system config counts as DVC would count it). Checkpoints on this machine (a demo's
checkpoints/) are not on the stack, and not the guard's business.

A stack of runMode jobs has no workers to ask: each run's pods keep its run root on the
checkpoints volume (clipforge.launcher.kubernetes, `Cluster.run_root`), so `jobs_stack_verdicts`
holds every run safe exactly when the outputs say that volume is retained; `make down` deletes
no run's Job, so a running one goes on (and keeps its GPUs).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fabric import Config

from clipforge.errors import LauncherError, UserError
from clipforge.launcher.connection import connect, join, label, q, run, targets
from clipforge.launcher.host import stored_checkpoints
from clipforge.launcher.host.run_dirs import DEFAULT_ROOT
from clipforge.launcher.stack import LAUNCH_LABEL, parse_stack_outputs, runs_jobs
from clipforge.store.remote import missing_from_store

EXIT_REFUSED = 3
# The run roots a launch on the stack uses unless clipforge.remote_root says otherwise; roots
# launches recorded on a worker are looked at too.
DEFAULT_ROOT_NAME = DEFAULT_ROOT


class GuardError(UserError, RuntimeError):
    """The guard could not decide (an unreachable worker, an unlistable remote): a refusal. A user
    error, as is any other found while deciding (damaged stack outputs): guard() refuses on those
    and on nothing else, so a bug in the guard keeps its traceback."""


@dataclass(frozen=True)
class Verdict:
    safe: bool
    reason: str


@dataclass(frozen=True)
class StoredCheckpoint:
    """The newest checkpoint of one training run on a worker (see stored_checkpoints)."""

    host: str
    launch_id: str
    run_id: str  # the training run (clipforge.ids)
    tag: str
    path: str
    retained: str | None  # the retained directory it lies under, if any
    md5: dict[str, str] | None  # file -> md5, when not retained
    problem: str | None = None
    store: str | None = None  # the run's store (storage.remote), if it has one

    def __str__(self) -> str:
        return f"{self.host} run {self.launch_id}: {self.run_id}/{self.tag} ({self.path})"


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


def checkpoint_safety(checkpoint: StoredCheckpoint, remote: RemoteStore | None) -> Verdict:
    """Would this checkpoint survive the release of its worker?"""
    if checkpoint.problem:
        return Verdict(False, f"{checkpoint}: {checkpoint.problem}")
    if checkpoint.retained:
        return Verdict(True, f"{checkpoint} is on retained storage ({checkpoint.retained})")
    not_stored = ""
    if checkpoint.store:
        why = missing_from_store(checkpoint.store, checkpoint.run_id, checkpoint.tag)
        if why is None:
            return Verdict(True, f"{checkpoint} is in the run store {checkpoint.store}")
        not_stored = f" and {why},"
    files = checkpoint.md5 or {}
    if remote is None:
        return Verdict(
            False,
            f"{checkpoint} is not on retained storage{not_stored} and no DVC remote is configured",
        )
    missing = [name for name, md5 in files.items() if not remote.has(md5)]
    if not missing:
        return Verdict(True, f"{checkpoint} is in the {remote.description}")
    return Verdict(
        False,
        f"{checkpoint} is not on retained storage{not_stored} and {len(missing)} of its "
        f"{len(files)} files are not in the {remote.description}",
    )


def stored_on_stack(outputs: dict) -> list[StoredCheckpoint]:
    """The newest checkpoint of every run on the stack's workers (none when it has no workers)."""
    if outputs.get("released") is True or not outputs.get("workers"):
        return []
    stack = parse_stack_outputs(outputs, Path("pulumi stack output"))  # LauncherError: a refusal
    specs, _ = targets([], lambda: stack)
    volumes = outputs.get("volumes") if isinstance(outputs.get("volumes"), dict) else {}
    retained = [
        v["mount_path"] for v in volumes.values() if isinstance(v, dict) and v.get("retained")
    ]
    roots = [f"{path}/{DEFAULT_ROOT_NAME}" for path in stack.mount_paths.values()]
    arguments = [*(f"--retained={p}" for p in retained), *(f"--root={p}" for p in roots)]
    arguments.append(f"--root=~/{DEFAULT_ROOT_NAME}")
    script = stored_checkpoints.script_source()
    found: dict[str, StoredCheckpoint] = {}
    for spec in specs:
        try:
            cxn = connect(spec, Config(), accept_new_host_key=False)
            listed = run(
                cxn, f"python3 -c {q(script)} {join(arguments)}", what="listing the checkpoints"
            )
        except LauncherError as error:
            raise GuardError(
                f"cannot check the checkpoints on worker {spec.host} ({error}); from outside the "
                f"cluster the workers are reached through `kubectl -n {stack.namespace} "
                f"port-forward pod/clipforge-worker-0 {stack.ssh_port}:{stack.ssh_port}`"
            ) from None
        for entry in json.loads(listed.stdout):
            checkpoint = StoredCheckpoint(host=label(cxn), **entry)
            found.setdefault(checkpoint.path, checkpoint)  # shared storage: seen by every node
    return list(found.values())


def jobs_stack_verdicts(outputs: dict) -> list[Verdict]:
    """The verdict on a jobs stack's runs: safe when their checkpoints volume is retained."""
    volumes = outputs.get("volumes") if isinstance(outputs.get("volumes"), dict) else {}
    volume = volumes.get("checkpoints")
    if not isinstance(volume, dict) or not isinstance(volume.get("mount_path"), str):
        return [Verdict(False, "the stack's outputs name no checkpoints volume; rerun `make up`")]
    where = f"the checkpoints volume ({volume.get('claim')}, {volume['mount_path']})"
    if volume.get("retained") is not True:
        return [Verdict(False, f"runs as Jobs keep their checkpoints on {where}, not retained")]
    return [
        Verdict(
            True,
            f"runs as Jobs keep their checkpoints on {where}, retained; `make down` stops no "
            f"run's Job: `kubectl -n {outputs.get('namespace')} get jobs -l {LAUNCH_LABEL}` "
            "lists them",
        )
    ]


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


def find_remote(repo: Path) -> RemoteStore | None:
    """The repository's default DVC remote; a failed look-up counts only if the remote is needed."""
    try:
        url = dvc_remote_url(repo)
    except GuardError as error:
        return UnknownRemote(str(error))
    return open_remote(url) if url else None


def guard(outputs: dict, remote_repo: Path, force: bool, command: str) -> bool:
    """Print the verdict on every checkpoint of the stack; True when the release may go ahead.
    `command`: what the user ran (`make down STACK=...`), for the messages."""
    try:
        if runs_jobs(outputs):
            verdicts = jobs_stack_verdicts(outputs)
        else:
            checkpoints = stored_on_stack(outputs)
            remote = find_remote(remote_repo) if any(not c.retained for c in checkpoints) else None
            verdicts = [checkpoint_safety(c, remote) for c in checkpoints]
    except UserError as error:  # GuardError, damaged stack outputs...: no decision, a refusal
        verdicts = [Verdict(False, str(error))]
    unsafe = [v.reason for v in verdicts if not v.safe]
    if not verdicts:
        print("teardown guard: ok, no checkpoint on the stack's workers: nothing to lose")
    for verdict in verdicts:
        if verdict.safe:
            print(f"teardown guard: ok, {verdict.reason}")
    if not unsafe:
        return True
    if force:
        for reason in unsafe:
            print(f"teardown guard: FORCE=1, releasing anyway although {reason}", file=sys.stderr)
        return True
    for reason in unsafe:
        print(f"teardown guard: refusing to release the GPUs: {reason}", file=sys.stderr)
    print(
        "  Keep runs on the retained checkpoints volume (fab's default run root), or let the run\n"
        "  store catch up (storage.remote; `fab status` shows the sync lag), or push the\n"
        "  checkpoint to the DVC remote from the worker, or run `"
        + command
        + " FORCE=1` to release anyway and lose it.",
        file=sys.stderr,
    )
    return False
