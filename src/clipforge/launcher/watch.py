"""`fab status`, `fab logs`, `fab stop`, `fab tensorboard`, `fab clean`: a run after its launch.

`fab status` and `fab tensorboard` read the run where it lives (clipforge.launcher.run_source: its
hosts, or its run store); logs, stop and clean act on its hosts."""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from decimal import Decimal

from clipforge.cli import exit_on_stop_signals
from clipforge.errors import LauncherError
from clipforge.ids import is_launch_id
from clipforge.launcher.commands import container_prefix
from clipforge.launcher.connection import probe, q, run
from clipforge.launcher.host import stored_checkpoints, supervisor
from clipforge.launcher.host.run_dirs import NODE_PREFIX, NodeLayout, current_marker, runs_dir
from clipforge.launcher.host.state import RunState
from clipforge.launcher.run_source import RunSource, StoredRun, node_status
from clipforge.launcher.session import Host, Settings, read_remote_state, remote_python
from clipforge.store.remote import missing_from_store

Say = Callable[[str], None]


def show_status(
    source: RunSource, price_per_gpu_hour: Decimal | None, say: Say, fab: str = "fab"
) -> RunState | None:
    """Where the run stands, as the place it lives in knows it: a table under `WHERE  launch
    RUN` (the recovery controller's rows last), a line per further node, and the next step of a
    run that has ended (`fab`: the command with the user's -H/-i). Returns the run's state."""
    rows = source.status_rows(price_per_gpu_hour) + source.recovery_rows()
    key_width = max(len(k) for k, _ in rows)
    columns = _terminal_columns()
    say(f"{source.where}  launch {source.launch_id}")
    indent = " " * (key_width + 4)
    for key, value in rows:
        # a long value goes on under itself, within the terminal (a word longer stays whole)
        lines = [str(value)]
        if columns is not None:
            lines = textwrap.wrap(
                str(value),
                max(columns - len(indent), 20),
                break_long_words=False,
                break_on_hyphens=False,
            ) or [""]
        say(f"  {key:<{key_width}}  {lines[0]}")
        for line in lines[1:]:
            say(indent + line)
    for line in source.more_status_lines():
        say(line)
    state = source.run_state()
    launch = f"--launch {source.launch_id}"
    on_hosts = not isinstance(source, StoredRun)
    if state is RunState.FINISHED:
        say(f"next: {fab} fetch {launch}" + ("" if on_hosts else " --from-store"))
    elif state is RunState.STOPPED:
        say(f"next: {fab} train --resume {source.launch_id}")
    elif state is RunState.FAILED and on_hosts:
        say(f"next: {fab} logs {launch}")
    return state


def _terminal_columns() -> int | None:
    """The width to wrap to: the terminal's, or COLUMNS'; None where the output is no terminal
    and COLUMNS names no width (a pipe, a file: whole rows, for grep)."""
    if os.environ.get("COLUMNS") or sys.stdout.isatty():
        return shutil.get_terminal_size((80, 24)).columns
    return None


def watch_status(
    source: RunSource,
    price_per_gpu_hour: Decimal | None,
    say: Say,
    interval_seconds: float,
    fab: str = "fab",
    wait: Callable[[float], object] = time.sleep,
) -> None:
    """`fab status --watch`: the status again every `interval_seconds` until the run has
    finished, failed or been stopped (a lost supervisor may be replaced by its keeper: watched
    on); Ctrl-C (SIGINT) or SIGTERM ends the watch, not the run (exit 128 + the signal)."""
    if interval_seconds < 1:
        raise LauncherError(f"--interval: at least 1 second, got {interval_seconds:g}")
    with exit_on_stop_signals():
        while True:
            state = show_status(source, price_per_gpu_hour, say, fab)
            if state is not None and state.terminal:
                return
            wait(interval_seconds)
            source.refresh()
            say("")


def show_logs(
    nodes: list[tuple[Host, NodeLayout]], settings: Settings, lines: int, follow: bool, say: Say
) -> None:
    """Each node's train.log (under a `node N (host)` header when there are several); --follow
    follows them all, each line tagged with its node, until their supervisors end, or until
    Ctrl-C (SIGINT) or SIGTERM, which exit 128 + the signal's number, not the error exit of an
    interrupt, whatever the shell handed down (as `tensorboard`). The threads following the
    nodes are daemons: the exit does not wait for their SSH sessions (each remote `tail` ends
    at the log's next line, its reader gone, or with the run)."""
    several = len(nodes) > 1
    infos = [node_status(host, layout, settings) for host, layout in nodes]
    if follow and any(info["supervisor_alive"] for info in infos):
        threads = [
            threading.Thread(target=_follow, args=(host, layout, info, lines, several), daemon=True)
            for (host, layout), info in zip(nodes, infos)
        ]
        with exit_on_stop_signals():
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
    pid = info.get("keeper_pid") or info["state"].get("supervisor_pid")
    if not info["supervisor_alive"] or not pid:
        return
    # Ends by itself when the keeper (else the supervisor) does: the run finished, stopped or
    # failed; a supervisor replaced by its keeper is no end.
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
            info = node_status(host, layout, settings)
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


def tensorboard(source: RunSource, local_port: int, say: Say) -> None:
    """TensorBoard on the run's logs at http://127.0.0.1:LOCAL_PORT/ (on its host through an SSH
    port-forward, or here on the logs downloaded from its store). Blocks until that TensorBoard
    ends, or until Ctrl-C (SIGINT) or SIGTERM, which stop it first and then exit 128 + the
    signal's number. Both are handled here, whatever the shell handed down: a command started
    with & in a script inherits SIGINT ignored, and Ctrl-C then never reached Python."""
    with exit_on_stop_signals(), source.serving_logs(local_port, say) as serving:
        say(f"TensorBoard for {source.launch_id}: http://127.0.0.1:{local_port}/  (Ctrl-C to stop)")
        while serving():
            time.sleep(1)


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
                    f"{host.label}: run {launch_id} is running; `fab stop --launch {launch_id}` first"
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


def unstored_checkpoints(host: Host, settings: Settings, launch_ids: list[str]) -> list[str]:
    """The newest checkpoints of the launches `launch_ids` on the host that their run store does not
    hold whole (none for a run without a store), each with its run and why; one listing of the
    host's checkpoints for all of them."""
    script = stored_checkpoints.script_source()
    listed = run(
        host.cxn,
        f"{q(settings.python)} -c {q(script)} --root {q(host.root)}",
        what="listing the run's checkpoints",
    )
    problems = []
    for entry in json.loads(listed.stdout):
        if entry["launch_id"] in launch_ids and entry.get("store"):
            why = missing_from_store(entry["store"], entry["run_id"], entry["tag"])
            if why:
                problems.append(
                    f"{host.label} run {entry['launch_id']}: {entry['run_id']}/{entry['tag']} {why}"
                )
    return problems


def all_runs(host: Host) -> list[str]:
    """The launches in the host's runs folder (what else it holds is no run of ours)."""
    result = probe(host.cxn, f"ls {q(runs_dir(host.root))} 2>/dev/null")
    return sorted(name for name in result.stdout.split() if is_launch_id(name))
