"""Launch, watch, stop and recover training runs on GPU hosts over SSH (see docs/launcher.md).

  fab check  [--gpus N] [--runtime docker|host]       preflight every host
  fab train  --gpus N [--nodes N] [--set k=v ...] [--smoke] [--runtime docker|host] [--data ...]
  fab status | fab logs [--follow] | fab tensorboard | fab stop | fab fetch [--push] | fab clean

Hosts: `fab -H user@host[:port][,...] -i KEY <task>`, or without -H the workers of the stack that
`make up` created (infra/stack-outputs.json). Thin definitions: the logic is in clipforge.remote.

Settings (defaults below) come from Fabric's config: a fabric.yaml next to this file, or
FABRIC_CLIPFORGE_<KEY> environment variables, e.g. FABRIC_CLIPFORGE_PYTHON=/opt/venv/bin/python.
"""
from __future__ import annotations

import contextlib
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

from fabric import task
from invoke import Collection, Exit

from clipforge.remote import fetch as fetch_mod
from clipforge.remote import launch as launch_mod
from clipforge.remote import preflight, session, watch
from clipforge.remote.errors import RemoteError
from clipforge.remote.options import make_options, parse_count
from clipforge.remote.settings import settings_from
from clipforge.remote.source import current_source

SETTINGS = {
    "remote_root": None,  # on the host; None: the stack's checkpoints volume, else ~/clipforge-runs
    "python": "python3",  # on the host; a venv's python puts that venv's bin/ first on PATH
    "stack_outputs": "infra/stack-outputs.json",
    "min_free_gb": 20,
    "backoff_seconds": 30,  # before the first restart; doubles per restart...
    "backoff_max_seconds": 900,  # ...up to this
    "stop_timeout_seconds": 900,  # a graceful stop gets this long to checkpoint
    "shm_size": "16g",  # docker runtime: /dev/shm for DataLoader workers and NCCL
    "registry": None,  # prefix of the image reference; else $REGISTRY
}

# Fabric calls a task once per -H host. These tasks act on all the hosts at once (one multi-node
# launch; every node preflighted before any starts), so later calls of the same task return.
_done: set[str] = set()


def _say(text: str) -> None:
    print(text, flush=True)


def _cli_hosts() -> list[str]:
    from fabric.main import program

    core = getattr(program, "core", None)
    value = core[0].args.hosts.value if core else None
    return [h for h in value.split(",") if h] if value else []


@contextlib.contextmanager
def _once(name: str):
    """Run the body once per fab invocation; RemoteError -> one clear line, exit 1."""
    if name in _done:
        yield False
        return
    _done.add(name)
    try:
        yield True
    except RemoteError as exc:
        raise Exit(f"fab {name}: error: {exc}", code=1) from None


def _runtime(runtime: str, from_stack: bool) -> str:
    """`auto`: `host` on stack workers (they run the image), `docker` on other hosts."""
    return ("host" if from_stack else "docker") if runtime == "auto" else runtime


def _nodes(c, settings, run: str | None):
    hosts, stack = session.open_hosts(_cli_hosts(), c.config, settings)
    return [(h, session.node_layout(h, i, run)) for i, h in enumerate(hosts)], stack


@task(help={"gpus": "GPUs the run will use per host (0: a CPU run; default: 1, or the stack's)",
            "runtime": "docker (default on -H hosts) or host (stack workers: already the image)",
            "data": "an absolute path on the host that must hold a data stage output",
            "accept_new_host_key": "record the key of a host never seen before (fresh hosts)"})
def check(c, gpus=None, runtime="auto", data=None, accept_new_host_key=False):
    """Preflight: SSH, GPUs, disk, Docker + NVIDIA runtime or the image's stack, image, storage."""
    with _once("check") as first:
        if not first:
            return
        settings = settings_from(c.config)
        specs, stack = session.host_specs(_cli_hosts(), settings)
        wanted = parse_count(gpus, "--gpus") if gpus is not None else \
            (stack.gpus_per_worker if stack else 1)
        image = launch_mod.image_reference_for(current_source(Path.cwd()), settings)
        any_failed = False
        for spec in specs:
            try:
                host = session.open_host(spec, c.config, settings, stack, accept_new_host_key)
            except RemoteError as exc:
                _say(preflight.format_table(spec.host, preflight.unreachable(str(exc))))
                any_failed = True
                continue
            check_spec = preflight.CheckSpec(
                gpus=wanted, runtime=_runtime(runtime, stack is not None), image=image,
                remote_root=host.root, python=settings.python, min_free_gb=settings.min_free_gb,
                data_path=data, mounts=tuple(sorted(stack.mount_paths.items())) if stack else ())
            rows = preflight.run_checks(host.cxn, check_spec)
            _say(preflight.format_table(host.label, rows))
            any_failed |= preflight.failed(rows)
        if any_failed:
            raise RemoteError("preflight failed (rows marked FAIL above)")


@task(iterable=["set_"],
      help={"gpus": "GPUs per node: DeepSpeed ranks per node (0: CPU ranks, for testing)",
            "nodes": "machines: one DeepSpeed launcher per node (no-SSH mode), hosts in -H order",
            "set_": "override a parameter, as `dvc exp run -S` (repeatable)",
            "smoke": "a few steps, a checkpoint saved and loaded back: validate a host first",
            "runtime": "docker: inside the pinned image; host: in place (the host is the image)",
            "data": "pull (DVC remote, default), build (data stage on the host) or /mounted/path",
            "allow_dirty": "ship the current commit even with uncommitted changes (not shipped)",
            "image": "image reference (default: docker/image.env, with $REGISTRY)",
            "max_restarts": "restarts after crashes before giving up",
            "master_port": "node 0's rendezvous port (multi-node)",
            "resume": "start the supervisors of an existing run again (after fab stop)",
            "accept_new_host_key": "record the key of a host never seen before (fresh hosts)"})
def train(c, gpus=None, nodes=1, set_=None, smoke=False, runtime="auto", data="pull",
          allow_dirty=False, image=None, max_restarts=5, master_port=29500, resume=None,
          accept_new_host_key=False):
    """Ship the commit and start a supervised training run, detached (survives disconnects)."""
    with _once("train") as first:
        if not first:
            return
        settings = settings_from(c.config)
        if resume:
            pairs, _ = _nodes(c, settings, resume)
            launch_mod.resume([h for h, _ in pairs], [lay for _, lay in pairs], settings, _say)
            return
        specs, stack = session.host_specs(_cli_hosts(), settings)
        if gpus is None and stack is None:
            raise RemoteError("--gpus: how many GPUs per node (0: CPU)")
        options = make_options(
            gpus=parse_count(gpus, "--gpus") if gpus is not None else stack.gpus_per_worker,
            nodes=parse_count(nodes, "--nodes"), sets=list(set_ or []), smoke=smoke,
            runtime=_runtime(runtime, stack is not None), allow_dirty=allow_dirty, data=data,
            image=image, max_restarts=parse_count(max_restarts, "--max-restarts"),
            master_port=parse_count(master_port, "--master-port"))
        prepared = launch_mod.prepare(current_source(Path.cwd()), options, settings)
        chosen = launch_mod.select_nodes(specs, options, from_stack=stack is not None)
        hosts = [session.open_host(s, c.config, settings, stack, accept_new_host_key) for s in chosen]
        run_id = launch_mod.launch(hosts, prepared, options, settings, stack, _say)
        _say(f"started run {run_id} on {', '.join(h.label for h in hosts)}"
             + (" (smoke)" if smoke else ""))
        _say("watch it: fab status | fab logs --follow | fab tensorboard; stop it: fab stop")


@task(help={"run": "run id (default: the newest on the host)",
            "price_per_gpu_hour": "for the cost (default: the stack's cost.price_per_gpu_hour)"})
def status(c, run=None, price_per_gpu_hour=None):
    """Run id, state, step/total, loss, samples/s, ETA, elapsed, restarts, cost."""
    with _once("status") as first:
        if not first:
            return
        settings = settings_from(c.config)
        pairs, stack = _nodes(c, settings, run)
        price = stack.price_per_gpu_hour if stack else None
        if price_per_gpu_hour is not None:
            try:
                price = Decimal(str(price_per_gpu_hour))
            except InvalidOperation:
                raise RemoteError(f"--price-per-gpu-hour: a number, got {price_per_gpu_hour!r}") from None
        watch.show_status(pairs, settings, price, _say)


@task(help={"run": "run id (default: the newest)", "follow": "keep printing until the run ends",
            "lines": "lines of history to show first"})
def logs(c, run=None, follow=False, lines=50):
    """The run's output (node 0): stage logs, and the supervisor's restart lines."""
    with _once("logs") as first:
        if not first:
            return
        settings = settings_from(c.config)
        pairs, _ = _nodes(c, settings, run)
        host, layout = pairs[0]
        watch.show_logs(host, layout, settings, parse_count(lines, "--lines"), follow, _say)


@task(help={"run": "run id (default: the newest)", "port": "local port of the forward"})
def tensorboard(c, run=None, port=6006):
    """TensorBoard on the run's logs, through an SSH port-forward; prints the local URL."""
    with _once("tensorboard") as first:
        if not first:
            return
        settings = settings_from(c.config)
        pairs, _ = _nodes(c, settings, run)
        host, layout = pairs[0]
        watch.tensorboard(host, layout, settings, parse_count(port, "--port"), _say)


@task(help={"run": "run id (default: the newest)"})
def stop(c, run=None):
    """Graceful stop: every node checkpoints, then exits; the supervisor restarts nothing."""
    with _once("stop") as first:
        if not first:
            return
        settings = settings_from(c.config)
        pairs, _ = _nodes(c, settings, run)
        watch.stop(pairs, settings, _say)


@task(help={"run": "run id (default: the newest)", "to": "local folder (default: runs/)",
            "push": "instead, `dvc push` the results from the host to the DVC remote"})
def fetch(c, run=None, to="runs", push=False):
    """Bring back metrics, the exported model and logs (or push them to the DVC remote)."""
    with _once("fetch") as first:
        if not first:
            return
        settings = settings_from(c.config)
        pairs, _ = _nodes(c, settings, run)
        if push:
            fetch_mod.push(pairs[0][0], pairs[0][1], settings, _say)
        else:
            fetch_mod.fetch(pairs, Path(to), _say)


@task(name="clean", help={"run": "run id (default: the newest)", "all_": "every run on the hosts"})
def clean_(c, run=None, all_=False):
    """Remove finished or stopped runs from the hosts (never a running one)."""
    with _once("clean") as first:
        if not first:
            return
        settings = settings_from(c.config)
        hosts, _ = session.open_hosts(_cli_hosts(), c.config, settings)
        for host in hosts:
            runs = watch.all_runs(host) if all_ else [session.run_id_on(host, run)]
            watch.clean(host, settings, runs, _say)


ns = Collection(check, train, status, logs, tensorboard, stop, fetch, clean_)
ns.configure({"clipforge": dict(SETTINGS)})

if __name__ == "__main__":
    sys.exit("run these tasks with `fab`, e.g. `fab --list`")
