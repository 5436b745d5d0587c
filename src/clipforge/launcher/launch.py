"""`fab train`: check every node, ship the commit, start a supervised run on each, detached.

Order matters for "nothing left running" on failure: everything that can be refused locally (a
dirty tree, bad --set, wrong number of hosts) is refused before connecting; every node is
preflighted before anything is written; a node that fails to start takes the started ones down.
"""

from __future__ import annotations

import dataclasses
import getpass
import io
import json
import os
import posixpath
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clipforge import envrecord
from clipforge.errors import LauncherError
from clipforge.ids import new_launch_id
from clipforge.image_env import parse_image_env
from clipforge.launcher import network, preflight
from clipforge.launcher.commands import NodeContext, hostfile_text, node_plan
from clipforge.launcher.connection import RESTRICT_MODE, RESTRICT_UMASK, join, probe, q, run
from clipforge.launcher.host.plan import PASSTHROUGH_ENV, RestartPolicy
from clipforge.launcher.host.record import RunRecord, SocketInterface
from clipforge.launcher.host.run_dirs import NodeLayout, current_marker
from clipforge.launcher.host.state import RunState
from clipforge.launcher.host.stored_checkpoints import RUN_ROOTS_FILE
from clipforge.launcher.host.supervisor import LIVE_EXIT
from clipforge.launcher.live_runs import refuse_a_second_launch
from clipforge.launcher.options import TrainOptions, resolve_params
from clipforge.launcher.run_source import StoredRun
from clipforge.launcher.session import (
    Host,
    Settings,
    container_user,
    read_remote_record,
    read_remote_state,
    remote_python,
)
from clipforge.launcher.source import Source, require_clean, source_at, write_bundle
from clipforge.launcher.stack import StackOutputs

START_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class Prepared:
    """What is known before connecting: the commit, its params, the image."""

    source: Source
    params: dict
    params_yaml: str
    image: str
    store: str | None  # the run store of its params (storage.remote), read from them once here
    repeats: dict | None = None  # `fab rerun`: the run it repeats (clipforge.repeats.Repeats)


def prepare(source: Source, options: TrainOptions, settings: Settings) -> Prepared:
    require_clean(source, options.allow_dirty)
    config = resolve_params(source.show("params.yaml"), options.overrides)
    image = options.image or image_reference_for(source, settings)
    if options.data == "pull" and (why := _pull_blocker(source)):
        raise LauncherError(
            f"--data pull: {why}; run `dvc repro data && dvc push` and commit dvc.lock, or use "
            f"--data build (the data stage on the host) or --data /mounted/path"
        )
    return Prepared(
        source=source,
        params=config.to_dict(),
        params_yaml=config.to_yaml(),
        image=image,
        store=config.storage.remote,
    )


def image_reference_for(source: Source, settings: Settings) -> str:
    """[$REGISTRY/]IMAGE_REPOSITORY:IMAGE_TAG from the commit's docker/image.env."""
    text = source.show("docker/image.env")
    if text is None:
        raise LauncherError("the commit has no docker/image.env; it names the training image")
    return parse_image_env(text).reference(settings.registry)  # ImageEnvError: a UserError


def choose_data(source: Source, requested: str, say: Callable[[str], None]) -> str:
    """`--data auto` (the default): pull the data the commit locks from its DVC remote when it
    can, else build it on the host, saying so. Any other value stands."""
    if requested != "auto":
        return requested
    why = _pull_blocker(source)
    if why is None:
        return "pull"
    say(f"data: {why}, so the data stage runs on the host (--data build)")
    return "build"


def _pull_blocker(source: Source) -> str | None:
    """Why `dvc pull data` cannot work for this commit; None when it can."""
    lock = source.show("dvc.lock")
    if lock is None or "  data:" not in lock:
        return "the commit's dvc.lock has no entry for the data stage"
    if "remote" not in (source.show(".dvc/config") or ""):
        return "the commit's .dvc/config names no DVC remote (`dvc remote add -d ...`)"
    return None


def select_nodes(specs: list, options: TrainOptions, from_stack: bool) -> list:
    if from_stack:
        if len(specs) < options.nodes:
            raise LauncherError(f"--nodes {options.nodes}: the stack has {len(specs)} workers")
        return specs[: options.nodes]
    if len(specs) != options.nodes:
        raise LauncherError(
            f"--nodes {options.nodes} needs exactly {options.nodes} host(s) in -H, got {len(specs)}"
        )
    return specs


def check_spec(
    host: Host,
    settings: Settings,
    stack: StackOutputs | None,
    *,
    gpus: int,
    runtime: str,
    image: str,
    data_path: str | None,
) -> preflight.CheckSpec:
    """What preflight checks on `host`, for `fab train` and `fab check` alike."""
    return preflight.CheckSpec(
        gpus=gpus,
        runtime=runtime,
        image=image,
        remote_root=host.root,
        python=settings.python,
        min_free_gb=settings.min_free_gb,
        data_path=data_path,
        mounts=tuple(sorted(stack.mount_paths.items())) if stack else (),
    )


def launch(
    hosts: list[Host],
    prepared: Prepared,
    options: TrainOptions,
    settings: Settings,
    stack: StackOutputs | None,
    say: Callable[[str], None],
    launch_id: str | None = None,
) -> str:
    """Preflight, ship, start; returns the launch id (a new one, or `launch_id`: a run moved
    here).
    Raises LauncherError with nothing left running."""
    data_path = options.data if options.mounted_data else None
    results = [
        preflight.run_checks(
            h.cxn,
            check_spec(
                h,
                settings,
                stack,
                gpus=options.gpus,
                runtime=options.runtime,
                image=prepared.image,
                data_path=data_path,
            ),
        )
        for h in hosts
    ]
    master_addr, interfaces = "", [None] * len(hosts)
    if options.nodes > 1:
        master_addr = network.master_address(hosts[0], stack, settings, options.allow_public_master)
        rows, interfaces = network.check_nodes(hosts, master_addr, options.master_port, settings)
        results = [own + more for own, more in zip(results, rows)]
    for host, rows in zip(hosts, results):
        say(preflight.format_table(host.label, rows))
    bad = [h.label for h, rows in zip(hosts, results) if preflight.failed(rows)]
    if bad:
        raise LauncherError(f"preflight failed on {', '.join(bad)}; nothing was started")
    mismatch = preflight.stack_mismatch([h.label for h in hosts], results)
    if mismatch:
        raise LauncherError(f"{mismatch}; nothing was started")
    refuse_a_second_launch(hosts, prepared.params, options.data)
    for host in hosts:
        _record_run_root(host)
    launch_id = launch_id or new_launch_id(prepared.source.commit)
    layouts = [
        NodeLayout(root=h.root, launch_id=launch_id, node_rank=i) for i, h in enumerate(hosts)
    ]
    policy = restart_policy(options, settings)
    started: list[tuple[Host, NodeLayout]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bundle = Path(tmp) / "code.bundle"
            write_bundle(prepared.source, bundle)
            for host, layout in zip(hosts, layouts):
                say(f"{host.label}: shipping {prepared.source.commit[:10]} to {layout.node_dir}")
                _ship(host, layout, bundle, prepared.source.commit)
        for host, layout in zip(hosts, layouts):
            user = container_user(host, prepared.image) if options.runtime == "docker" else None
            node = NodeContext(
                layout=layout,
                hosts=[h.label for h in hosts],
                master_addr=master_addr,
                host_python=settings.python,
                user=user or "",
                image=prepared.image,
                shm_size=settings.shm_size,
                env=network.socket_env(interfaces[layout.node_rank]),
            )
            plan = node_plan(
                options, node, policy, init_dvc=prepared.source.show(".dvc/config") is None
            )
            _write_run_files(
                host, layout, prepared, options, hosts, plan, master_addr, interfaces, user
            )
            if user and not user.startswith("0:"):
                # the containers write the checkout's outputs and their HOME as this user
                run(
                    host.cxn,
                    f"chown -R {q(user)} {q(layout.run_dir)}",
                    what=f"handing the run directory to the container user {user}",
                )
        for host, layout in zip(hosts, layouts):
            start_supervisor(host, layout, settings)
            started.append((host, layout))
            probe(
                host.cxn,
                f"echo {q(launch_id)} > {q(current_marker(host.root))}.tmp && "
                f"mv {q(current_marker(host.root))}.tmp {q(current_marker(host.root))}",
            )
    except BaseException:
        stop_nodes(started, settings)
        raise
    return launch_id


def restart_policy(options: TrainOptions, settings: Settings) -> RestartPolicy:
    """The supervisor's restart policy of a launch, wherever its nodes run."""
    return RestartPolicy(
        max_restarts=options.max_restarts,
        backoff_seconds=settings.backoff_seconds,
        backoff_max_seconds=settings.backoff_max_seconds,
        stop_timeout_seconds=settings.stop_timeout_seconds,
        min_gpus=options.min_gpus,
    )


def stop_nodes(nodes: list[tuple[Host, NodeLayout]], settings: Settings) -> None:
    """Ask the supervisors of a run being started to stop: a start that fails leaves nothing
    running (also when the run started but its recovery controller did not)."""
    for host, layout in nodes:
        probe(host.cxn, remote_python(settings, layout, "supervisor", "stop", layout.node_dir))


def launched_by() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


def _record_run_root(host: Host) -> None:
    """Note the run root in the host's list, where `make down` looks for checkpoints to keep."""
    roots = f'"$HOME"/{RUN_ROOTS_FILE}'
    run(
        host.cxn,
        f'mkdir -p "$HOME"/{posixpath.dirname(RUN_ROOTS_FILE)} && '
        f"{{ grep -qxF {q(host.root)} {roots} 2>/dev/null || echo {q(host.root)} >> {roots}; }}",
        what="recording the run root",
    )


def _ship(host: Host, layout: NodeLayout, bundle: Path, commit: str) -> None:
    run(
        host.cxn,
        f"{RESTRICT_UMASK} && mkdir -p {q(layout.run_dir)} && "
        f"mkdir {q(layout.node_dir)} {q(layout.home)}",
        what=f"creating {layout.node_dir} (a run of that id exists already?)",
    )
    remote_bundle = posixpath.join(layout.node_dir, "code.bundle")
    host.cxn.put(str(bundle), remote_bundle)
    # DVC commits experiments and stashes a crashed attempt's changes in the checkout: git needs an
    # identity there, which a fresh host (or the container's HOME) does not have. The launcher's.
    run(
        host.cxn,
        f"{RESTRICT_UMASK} && {clone_command(q(remote_bundle), q(layout.code), commit)}",
        what="cloning the shipped commit",
    )


def clone_command(bundle: str, code: str, commit: str) -> str:
    """The shell command that makes the checkout `code` at `commit` from the shipped `bundle`,
    then removes the bundle (both shell words, quoted or with variables a caller expands: a
    Kubernetes pod knows its node directory only when it runs)."""
    return (
        f"git clone --quiet {bundle} {code} && "
        f"git -C {code} -c advice.detachedHead=false checkout --quiet {q(commit)} "
        f"&& git -C {code} config user.name {q(getpass.getuser())} "
        f"&& git -C {code} config user.email {q(launched_by())} "
        f"&& rm {bundle}"
    )


def _write_run_files(
    host: Host,
    layout: NodeLayout,
    prepared: Prepared,
    options: TrainOptions,
    hosts: list[Host],
    plan,
    master_addr: str,
    interfaces: list,
    user: str | None,
) -> None:
    several = options.nodes > 1
    record = run_record(
        layout.launch_id,
        prepared,
        options,
        [h.label for h in hosts],
        checkpoints_dir=layout.shared_checkpoints if several else layout.output("checkpoints"),
        master=f"{master_addr}:{options.master_port}" if several else None,
        interfaces=tuple(
            SocketInterface(interface=i.name, address=i.address, chosen_by=i.chosen_by)
            for i in interfaces
        )
        if several
        else None,
        user=user,
    )
    files = {
        layout.record: record.to_json(),
        layout.resolved_params: prepared.params_yaml,
        layout.plan: plan.to_json(),
    }
    if options.nodes > 1:
        files[layout.hostfile] = hostfile_text(list(record.hosts), max(options.gpus, 1))
    for path, text in files.items():
        host.cxn.put(io.BytesIO(text.encode("utf-8")), path)
    command = f"chmod {RESTRICT_MODE} {join(files)}"
    if options.nodes > 1:
        command += f" && {RESTRICT_UMASK} && mkdir -p {q(layout.shared_checkpoints)}"
    run(host.cxn, command, what="writing the run's files")


def run_record(
    launch_id: str,
    prepared: Prepared,
    options: TrainOptions,
    hosts: list[str],
    *,
    checkpoints_dir: str,
    master: str | None,
    interfaces: tuple[SocketInterface, ...] | None,
    user: str | None,
) -> RunRecord:
    """The launch's run.json, wherever its nodes run (SSH hosts or Kubernetes pods)."""
    several = options.nodes > 1
    return RunRecord(
        launch_id=launch_id,  # the training run's id is the stage's (clipforge.ids)
        commit=prepared.source.commit,
        dirty_paths_not_shipped=tuple(prepared.source.dirty),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        launched_by=launched_by(),
        hosts=tuple(hosts),
        host=hosts[0],
        num_nodes=options.nodes,
        gpus_per_node=options.gpus,
        runtime=options.runtime,
        image=prepared.image,
        container_user=user,
        data=options.data,
        smoke=options.smoke,
        executor="dvc exp run"
        if options.through_dvc
        else ("deepspeed launcher, no-ssh" if several else "python -m clipforge.train"),
        overrides=tuple(options.overrides),
        params=prepared.params,
        checkpoints_dir=checkpoints_dir,
        master=master,
        allow_public_master=options.allow_public_master,
        socket_interfaces=interfaces,
        max_restarts=options.max_restarts,
        min_gpus=options.min_gpus,
        env_passed_through=tuple(n for n in PASSTHROUGH_ENV if n in os.environ),
        environment=envrecord.gather(
            "fab train",
            params_text=prepared.params_yaml,
            code=envrecord.Code(commit=prepared.source.commit, dirty=False, diff_sha256=None),
            environ={envrecord.IMAGE_ENV: prepared.image} if options.runtime == "docker" else {},
            plan={"num_nodes": options.nodes, "gpus_per_node": options.gpus},
        ).to_dict(),
        repeats=prepared.repeats,
    )


def start_supervisor(host: Host, layout: NodeLayout, settings: Settings) -> None:
    """Start the node's supervisor detached; secrets go over the SSH channel's stdin only."""
    secrets = {name: os.environ[name] for name in PASSTHROUGH_ENV if name in os.environ}
    bin_dir = posixpath.dirname(settings.python)
    path = f'export PATH={q(bin_dir)}:"$PATH" && ' if bin_dir else ""
    command = f"cd {q(layout.node_dir)} && {path}" + remote_python(
        settings, layout, "supervisor", "launch", layout.node_dir
    )
    started = probe(host.cxn, command, in_stream=io.StringIO(json.dumps(secrets)))
    if started.exited == LIVE_EXIT:  # a live supervisor or keeper: the host's one line names it
        raise LauncherError(f"{host.label}: {started.stderr.strip()}")
    if not started.ok:
        output = (started.stderr.strip() or started.stdout.strip()).splitlines()[-8:]
        raise LauncherError(
            f"{host.label}: starting the supervisor failed (exit {started.exited}):\n  "
            + "\n  ".join(output or ["(no output)"])
        )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        state = read_remote_state(host, layout)
        if state and state.state.started:
            return
        if state and state.state is RunState.FAILED:
            break
        time.sleep(0.5)
    log = probe(host.cxn, f"tail -n 20 {q(layout.supervisor_log)} {q(layout.train_log)}").stdout
    raise LauncherError(f"{host.label}: the supervisor did not start:\n{log}")


def resume(
    hosts: list[Host], layouts: list[NodeLayout], settings: Settings, say: Callable[[str], None]
) -> None:
    """Start the supervisors of an existing run again (after `fab stop`, or a lost supervisor)."""
    for host, layout in zip(hosts, layouts):
        state = read_remote_state(host, layout)
        if state and state.state is RunState.FINISHED:
            raise LauncherError(
                f"{host.label}: run {layout.launch_id} has finished; nothing to resume"
            )
        commit = read_remote_record(host, layout).commit
        # safe.directory: with the docker runtime the checkout belongs to the container's user
        checkout = probe(
            host.cxn, f"git -c safe.directory={q(layout.code)} -C {q(layout.code)} rev-parse HEAD"
        ).stdout.strip()
        if checkout != commit:
            raise LauncherError(
                f"{host.label}: node {layout.node_rank}'s checkout is at commit "
                f"{checkout[:10] or '(none)'}, the run's commit is {commit[:10]}: every node "
                f"must train the same code (`git -C {layout.code} checkout {commit}` there); "
                f"nothing was started"
            )
    for host, layout in zip(hosts, layouts):
        say(f"{host.label}: resuming {layout.launch_id} node {layout.node_rank}")
        start_supervisor(host, layout, settings)


def has_run(host: Host, launch_id: str) -> bool:
    return probe(host.cxn, f"test -d {q(posixpath.join(host.root, 'runs', launch_id))}").ok


def stored_options(record: RunRecord) -> TrainOptions:
    """The options of a launch as its record keeps them: what a run started again (on other
    hosts, or as a new Kubernetes Job) trains with."""
    return TrainOptions(
        gpus=record.gpus_per_node,
        nodes=record.num_nodes,
        overrides=record.overrides,
        smoke=record.smoke,
        runtime=record.runtime,
        data=record.data,
        max_restarts=record.max_restarts,
        min_gpus=record.min_gpus,
        image=record.image,
        allow_public_master=record.allow_public_master,
    )


def move(
    hosts: list[Host],
    launch_id: str,
    remote: str | None,
    settings: Settings,
    stack: StackOutputs | None,
    say: Callable[[str], None],
) -> None:
    """`fab train --resume ID` on hosts that never saw the run: its launch as the run store
    keeps it (launches/ID.json), started again there under the same id, from the same commit
    and options. The train stage finds no local checkpoint and resumes from the store's."""
    say(f"run {launch_id} is not on {', '.join(h.label for h in hosts)}: looking in the run store")
    record = StoredRun.open(remote, launch_id).record()
    options = stored_options(record)
    if len(hosts) != options.nodes:
        raise LauncherError(
            f"run {launch_id} trains on {options.nodes} node(s): give as many hosts in -H, got "
            f"{len(hosts)}"
        )
    prepared = dataclasses.replace(
        prepare(source_at(Path.cwd(), record.commit), options, settings), repeats=record.repeats
    )
    say(
        f"moving run {launch_id} there from {remote} (commit {record.commit[:10]}, last on "
        f"{record.host})"
    )
    launch(hosts, prepared, options, settings, stack, say, launch_id=launch_id)
