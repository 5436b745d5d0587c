"""`fab status`, `fab logs`, `fab stop`, `fab tensorboard`, `fab clean`: a run after its launch."""

from __future__ import annotations

import json
import posixpath
import signal
import threading
import time
from collections.abc import Callable
from decimal import Decimal

from clipforge.launcher import LauncherError, recovery
from clipforge.launcher.commands import (
    container_prefix,
    docker_cleanup_argv,
    docker_run_argv,
)
from clipforge.launcher.connection import join, probe, q, run
from clipforge.launcher.host import status as status_mod
from clipforge.launcher.host import supervisor
from clipforge.launcher.host.run_dirs import NODE_PREFIX, NodeLayout, current_marker, runs_dir
from clipforge.launcher.host.state import RunState
from clipforge.launcher.session import (
    Host,
    Settings,
    later_container,
    read_remote_record,
    read_remote_state,
    remote_python,
)
from clipforge.util import wait_script

Say = Callable[[str], None]


def collect(host: Host, layout: NodeLayout, settings: Settings) -> dict:
    result = run(
        host.cxn,
        remote_python(settings, layout, "status", layout.node_dir),
        what="reading the run's status",
    )
    return json.loads(result.stdout)


def show_status(
    nodes: list[tuple[Host, NodeLayout]], settings: Settings, price: Decimal | None, say: Say
) -> None:
    for index, (host, layout) in enumerate(nodes):
        info = collect(host, layout, settings)
        if index == 0:
            rows = status_mod.summarize(info, price) + _recovery_rows(host, layout)
            width = max(len(k) for k, _ in rows)
            say(f"{host.label}  launch {layout.launch_id}")
            for key, value in rows:
                say(f"  {key:<{width}}  {value}")
        else:
            state = info["state"]
            say(
                f"{host.label}  node {layout.node_rank}: {state.get('state')}, "
                f"restarts {state.get('restarts', 0)}"
            )


def _recovery_rows(host: Host, layout: NodeLayout) -> list[tuple[str, str]]:
    """The recovery controller's rows (`fab train --spare`): its state and the run's moves, as
    its record in the run directory has them; none for a run without a controller."""
    path = posixpath.join(layout.run_dir, recovery.RECOVERY_FILE)
    result = probe(host.cxn, f"cat {q(path)}")
    if not result.ok or not result.stdout.strip():
        return []
    try:
        return recovery.status_rows(recovery.parse_record(result.stdout, f"{host.label}:{path}"))
    except recovery.RecordError as exc:
        return [("recovery", f"unreadable: {exc}")]


def show_logs(
    nodes: list[tuple[Host, NodeLayout]], settings: Settings, lines: int, follow: bool, say: Say
) -> None:
    """Each node's train.log (under a `node N (host)` header when there are several); --follow
    follows them all, each line tagged with its node, until their supervisors end."""
    several = len(nodes) > 1
    infos = [collect(host, layout, settings) for host, layout in nodes]
    if follow and any(info["supervisor_alive"] for info in infos):
        threads = [
            threading.Thread(target=_follow, args=(host, layout, info, lines, several))
            for (host, layout), info in zip(nodes, infos)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return
    for host, layout in nodes:
        if several:
            say(f"==> node {layout.node_rank} ({host.label}) <==")
        result = run(host.cxn, f"tail -n {lines} {q(layout.train_log)}", what="reading train.log")
        say(result.stdout.rstrip("\n"))
    if follow:
        state = infos[0]["state"].get("state")
        say(f"(run {nodes[0][1].launch_id} is {state}: nothing more to follow)")


def _follow(host: Host, layout: NodeLayout, info: dict, lines: int, tag: bool) -> None:
    pid = info["state"].get("supervisor_pid")
    if not info["supervisor_alive"] or not pid:
        return
    # Ends by itself when the supervisor does (run finished, stopped or failed).
    command = f"tail -n {lines} -F --pid={int(pid)} {q(layout.train_log)} 2>/dev/null"
    if tag:
        command += f" | sed -u 's/^/[node {layout.node_rank}] /'"
    host.cxn.run(command, warn=True, in_stream=False)


def stop(
    nodes: list[tuple[Host, NodeLayout]], settings: Settings, say: Say, fab: str = "fab"
) -> None:
    """Ask every node to checkpoint and exit; wait until they have; show the checkpoint and, for
    a run that has work left, how to resume it (`fab`: the command with the user's -H/-i)."""
    finished = 0
    for host, layout in nodes:
        state = read_remote_state(host, layout)
        if state and state.state.terminal:
            say(f"{host.label}: run {layout.launch_id} already {state.state}")
            finished += state.state is RunState.FINISHED
            continue
        run(
            host.cxn,
            remote_python(settings, layout, "supervisor", "stop", layout.node_dir),
            what="asking the supervisor to stop",
        )
        say(
            f"{host.label}: stop requested; waiting for the checkpoint (up to "
            f"{settings.stop_timeout_seconds:g}s)"
        )
    deadline = time.monotonic() + settings.stop_timeout_seconds + 60
    for host, layout in nodes:
        while True:
            info = collect(host, layout, settings)
            if not info["supervisor_alive"]:
                break
            if time.monotonic() > deadline:
                raise LauncherError(
                    f"{host.label}: the run did not stop within "
                    f"{settings.stop_timeout_seconds:g}s; see `fab logs`"
                )
            time.sleep(1)
        checkpoint = info.get("latest_checkpoint")
        say(
            f"{host.label}: {info['state'].get('state')}; latest checkpoint: "
            f"{checkpoint or 'none (stopped before the first training step)'}"
        )
    if nodes and finished < len(nodes):
        say(f"resume with: {fab} train --resume {nodes[0][1].launch_id}")
    elif nodes:
        say(f"nothing to stop: see its results with {fab} status, {fab} fetch")


def tensorboard(
    host: Host, layout: NodeLayout, settings: Settings, local_port: int, say: Say
) -> None:
    """TensorBoard on the host for this run's logs, reached through an SSH port-forward. Blocks
    until interrupted, then stops that TensorBoard."""
    record = read_remote_record(host, layout)
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
        _wait_http(host, settings, remote_port)
        with host.cxn.forward_local(local_port, remote_port=remote_port, remote_host="127.0.0.1"):
            say(
                f"TensorBoard for {layout.launch_id}: http://127.0.0.1:{local_port}/  (Ctrl-C to stop)"
            )
            _block_until_interrupted()
    finally:
        probe(host.cxn, stop_cmd)


def _wait_http(host: Host, settings: Settings, port: int, timeout_seconds: int = 120) -> None:
    script = wait_script(f"http://127.0.0.1:{port}/", timeout_seconds)
    run(host.cxn, f"{q(settings.python)} -c {q(script)}", what="waiting for TensorBoard to answer")


def _block_until_interrupted() -> None:
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def clean(host: Host, settings: Settings, launch_ids: list[str], say: Say) -> None:
    """Remove runs from the host (code, checkpoints, logs); never a running one."""
    for launch_id in launch_ids:
        run_dir = posixpath.join(runs_dir(host.root), launch_id)
        nodes = probe(host.cxn, f"ls -d {q(run_dir)}/{NODE_PREFIX}* 2>/dev/null").stdout.split()
        for node_dir in nodes:
            layout = NodeLayout.of_node_dir(node_dir)
            state = read_remote_state(host, layout)
            pid = state.supervisor_pid if state else None
            if (
                pid
                and probe(
                    host.cxn,
                    f"grep -qs {supervisor.MODULE} /proc/{int(pid)}/cmdline "
                    f"&& grep -qs {q(node_dir)} /proc/{int(pid)}/cmdline",
                ).ok
            ):
                raise LauncherError(
                    f"{host.label}: run {launch_id} is running; `fab stop --run {launch_id}` first"
                )
        probe(
            host.cxn,
            f"command -v docker >/dev/null && docker ps -aq --filter "
            f"name={q(container_prefix(launch_id))} | xargs -r docker rm --force",
        )
        run(host.cxn, f"rm -rf {q(run_dir)}", what=f"removing {run_dir}")
        marker = current_marker(host.root)
        probe(
            host.cxn, f'[ "$(cat {q(marker)} 2>/dev/null)" = {q(launch_id)} ] && rm -f {q(marker)}'
        )
        say(f"{host.label}: removed run {launch_id}")


def all_runs(host: Host) -> list[str]:
    result = probe(host.cxn, f"ls {q(runs_dir(host.root))} 2>/dev/null")
    return sorted(result.stdout.split())
