"""Launch, watch, stop and recover training runs on GPU hosts over SSH (see docs/launcher.md).

  fab check  [--gpus N] [--runtime host|docker]       preflight every host
  fab train  --gpus N [--nodes N] [--set k=v ...] [--smoke] [--runtime host|docker] [--data ...]
             [--spare HOST[,HOST] [--controller HOST]]   a controller moves the run if a host dies
             [--kubernetes]   on the stack's cluster as a Job/JobSet, which Kubernetes replaces
                              (the default without -H when the stack's runMode is jobs)
  fab status [--watch] | fab logs [--follow] | fab tensorboard | fab stop | fab fetch [--push]
  fab clean
  fab status|fetch|tensorboard --launch ID --from-store (or --launch ID and no -H)   (the run store)
  fab rerun RUN [--on HOST | --kubernetes] [--allow-stack-change]   a finished run repeated: same
             commit, params, runtime; refused when its data or stack moved
  fab runs [--sort-by METRIC] [--params]   every run here (experiments, fetched), best first
  fab compare RUN_A RUN_B [--tolerance X]   two runs side by side, exit 0/1 on the verdict
  fab publish RUN --to URL | fab pull URL --to DIR   a model handed on, and fetched back verified
  (--launch: a launch id, as `fab train` prints it; --run is the same flag)

Hosts: `fab -H user@host[:port][,...] -i KEY <task>`, or without -H the workers of the stack that
`make up` created (infra/stack-outputs.json). Thin definitions: the logic is in clipforge.launcher.

Settings (docs/launcher.md's table, declared in clipforge.launcher.session.Settings) come from
Fabric's config: a fabric.yaml next to this file, or FABRIC_CLIPFORGE_<KEY> environment
variables, e.g. FABRIC_CLIPFORGE_PYTHON=/opt/venv/bin/python.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

import fabric
from fabric import Config, Connection
from invoke import Collection, Exit, Task

from clipforge.errors import LauncherError, UserError
from clipforge.ids import checked_launch_id
from clipforge.launcher import controller as controller_mod
from clipforge.launcher import fetch as fetch_mod
from clipforge.launcher import kubernetes as kubernetes_mod
from clipforge.launcher import launch as launch_mod
from clipforge.launcher import preflight, session, watch
from clipforge.launcher import rerun as rerun_mod
from clipforge.launcher.backend import LaunchBackend
from clipforge.launcher.connection import HostSpec, spec_of
from clipforge.launcher.kubernetes import KubernetesJobs
from clipforge.launcher.options import TrainOptions, checkout_store, make_options, parse_count
from clipforge.launcher.recovery import RecoveryRule
from clipforge.launcher.run_source import RunSource, StoredRun
from clipforge.launcher.session import Settings, settings_from
from clipforge.launcher.source import current_source
from clipforge.launcher.ssh_hosts import Failover, SshHosts
from clipforge.repro import commands as repro
from clipforge.repro import runs as runs_mod

# Each setting's default, declared with its type and doc in clipforge.launcher.session.Settings.
SETTINGS = session.defaults()


try:  # before Fabric reads fabric.yaml on its own terms (see session.check_fabric_yaml)
    session.check_fabric_yaml(Path(__file__).resolve().parent, SETTINGS)
except UserError as error:
    sys.exit(f"fab: error: {error}")


class FabTask(fabric.tasks.Task):
    """Fabric's task, with two short flags Invoke would give left out. Invoke gives an option the
    first character of its name that is free: for min_gpus (m, i and n taken) the `-` of
    min-gpus, which `fab --help train` showed as `--=STRING`; and `-i`, which after the task
    would read as Fabric's -i KEY misplaced (--image keeps its -i, refused with a hint there:
    session.refuse_identity_after_task)."""

    def arg_opts(self, name, default, taken_names):
        opts = super().arg_opts(name, default, taken_names)
        opts["names"] = [n for n in opts["names"] if n != "-" and (n != "i" or name == "image")]
        return opts


task = functools.partial(fabric.task, klass=FabTask)


@dataclass(frozen=True)
class Invocation:
    """What every task starts from."""

    config: Config  # Fabric's: the -i key, the ssh config, the `clipforge` section
    settings: Settings
    hosts: list[HostSpec]  # -H, in order (position = node rank); empty: the stack's workers


def all_hosts_task(name: str | None = None, **task_options):
    """A task acting on all its hosts at once; a user error (clipforge.errors.UserError, such as
    LauncherError) ends it with one line and exit 1.

    With -H, Fabric calls a task once per host, with a Connection to that host. A multi-node
    launch needs the hosts together (and every node preflighted before any starts), so these
    calls only note their host, and the body runs after them, once, in the task's post-task
    (Fabric runs post-tasks once, not per host). Without -H the one call notes no host.
    """

    def decorate(body):
        noted: list[tuple[HostSpec | None, dict]] = []

        @functools.wraps(body)  # the task's options and help are the body's
        def note_host(c, **options):
            noted.append((spec_of(c) if isinstance(c, Connection) else None, options))

        def act_on_all_hosts(c):
            if not noted:  # a Fabric that ran post-tasks per host: the first one did the work
                return
            hosts, options = [spec for spec, _ in noted if spec], noted[0][1]
            noted.clear()
            try:
                body(Invocation(c.config, settings_from(c.config), hosts), **options)
            except UserError as exc:  # LauncherError, and any other the user can fix
                raise Exit(f"fab {name or body.__name__}: error: {exc}", code=1) from None

        return task(note_host, name=name, post=[Task(act_on_all_hosts)], **task_options)

    return decorate


def _say(text: str) -> None:
    print(text, flush=True)


STORE_HELP = "the run store (default: storage.remote of params.yaml)"
LAUNCH_HELP = "launch id (YYYYMMDD-HHMMSS-commit, as `fab train` printed it; default: the newest)"
RUN_HELP = "the same as --launch"
# The rule of _run_source, in the help of each task that reads a run where it lives.
FROM_STORE_DEFAULT = (
    " (the default with --launch and no -H, when there is no stack, its runs are Jobs or --store "
    "is given)"
)


def _launch_flag(launch: str | None, run: str | None) -> str | None:
    """The launch id of --launch, or of --run, its alias."""
    if launch and run and launch != run:
        raise LauncherError(f"--launch {launch} and --run {run}: one launch id, under either name")
    return launch or run


def _store(store: str | None) -> str | None:
    return store or checkout_store(Path.cwd())


def _nodes(c: Invocation, run: str | None):
    hosts, stack = session.open_hosts(c.hosts, c.config, c.settings)
    return [(h, session.node_layout(h, i, run)) for i, h in enumerate(hosts)], stack


def _jobs_stack(c: Invocation) -> bool:
    """No -H, and the stack runs each run as a Kubernetes Job (runMode jobs): no SSH workers."""
    return not c.hosts and kubernetes_mod.stack_runs_jobs(c.settings.stack_outputs)


def _backend(
    c: Invocation,
    kubernetes: bool = False,
    *,
    runtime: str = "host",
    failover: Failover | None = None,
    accept_new_host_key: bool = False,
) -> LaunchBackend:
    """Where the run goes or is: the stack's cluster as Jobs (--kubernetes, or a stack of
    runMode jobs without -H), else SSH hosts (-H, or the stack's workers)."""
    failover = failover or Failover()
    if kubernetes or _jobs_stack(c):
        kubernetes_mod.check_options(hosts=c.hosts, spare=failover.spare, runtime=runtime)
        cluster = kubernetes_mod.load_cluster(c.settings.stack_outputs)
        return KubernetesJobs(cluster, c.settings, _say, failover.max_moves, os.environ)
    return SshHosts(
        c.hosts,
        c.config,
        c.settings,
        _say,
        accept_new_host_key=accept_new_host_key,
        failover=failover,
    )


def _run_source(c: Invocation, run: str | None, from_store: bool, store: str | None) -> RunSource:
    """Where the run lives: its run store with --from-store, or with --launch when there is no host
    to ask (no -H, and no stack or one whose runs are Jobs) or a store is named (--store); else
    where its backend keeps it."""
    no_host = not c.hosts and run and (store or not c.settings.stack_outputs.exists())
    if from_store or (no_host and not _jobs_stack(c)):
        return StoredRun.open(_store(store), run)
    return _backend(c).status(run, _store(store) if run else None)


@all_hosts_task(
    help={
        "gpus": "GPUs the run will use per host (0: a CPU run; default: 1, or the stack's)",
        "runtime": "host (default: the host's own Python stack) or docker (the pinned image)",
        "data": "an absolute path on the host that must hold a data stage output",
        "image": "image reference (default: docker/image.env, with $REGISTRY)",
        "accept_new_host_key": "record the key of a host never seen before (fresh hosts)",
    }
)
def check(
    c: Invocation, gpus=None, runtime="host", data=None, image=None, accept_new_host_key=False
):
    """Preflight: SSH, GPUs, disk, Docker + NVIDIA runtime or the image's stack, image, storage."""
    session.refuse_identity_after_task(sys.argv, "check")
    specs, stack = session.host_specs(c.hosts, c.settings)
    wanted = (
        parse_count(gpus, "--gpus") if gpus is not None else (stack.gpus_per_worker if stack else 1)
    )
    image = image or launch_mod.image_reference_for(current_source(Path.cwd()), c.settings)
    any_failed = False
    for spec in specs:
        try:
            host = session.open_host(spec, c.config, c.settings, stack, accept_new_host_key)
        except LauncherError as exc:
            _say(preflight.format_table(spec.host, preflight.unreachable(str(exc))))
            any_failed = True
            continue
        check_spec = launch_mod.check_spec(
            host, c.settings, stack, gpus=wanted, runtime=runtime, image=image, data_path=data
        )
        rows = preflight.run_checks(host.cxn, check_spec)
        _say(preflight.format_table(host.label, rows))
        any_failed |= preflight.failed(rows)
    if any_failed:
        raise LauncherError("preflight failed (rows marked FAIL above)")


@all_hosts_task(
    iterable=["set_"],
    help={
        "gpus": "GPUs per node: DeepSpeed ranks per node (0: CPU ranks, for testing)",
        "nodes": "machines: one DeepSpeed launcher per node (no-SSH mode), hosts in -H order",
        "set_": "override a parameter, as `dvc exp run -S` (repeatable)",
        "smoke": "a few steps, a checkpoint saved and loaded back: validate a host first",
        "runtime": "host (default): the host's own Python stack; docker: the pinned image",
        "data": "auto (default: pull if the commit has a DVC remote, else build), pull, build "
        "(the data stage on the host) or /mounted/path",
        "allow_dirty": "ship the current commit even with uncommitted changes (not shipped)",
        "image": "image reference (default: docker/image.env, with $REGISTRY)",
        "max_restarts": "restarts after crashes before giving up",
        "min_gpus": "after losing GPUs, go on with at least this many per node (default: half)",
        "master_port": "node 0's rendezvous port (multi-node)",
        "allow_public_master": "multi-node: let node 0's rendezvous listen on a public address "
        "(firewall --master-port to the nodes first; docs/launcher.md)",
        "resume": "start the supervisors of an existing run again (after fab stop); on hosts "
        "that never saw it, move it there from the run store; with --kubernetes, submit it "
        "again as a new Job (JobSet) from the run store, with a fresh --max-moves",
        "store": "with --resume: " + STORE_HELP,
        "accept_new_host_key": "record the key of a host never seen before (fresh hosts)",
        "spare": "host(s) to move the run to when a training host is gone (user@host[:port],...); "
        "a recovery controller watches the run and moves it, from the run store",
        "controller": "with --spare: the host the recovery controller runs on (default: the "
        "first spare); never a training host",
        "controller_key": "with --spare: the private key's path on the controller's host that "
        "reaches the hosts (default: the -i path)",
        "max_moves": "with --spare: moves before the controller gives up (run_failed); with "
        "--kubernetes: pod replacements (Job backoffLimit, JobSet maxRestarts)",
        "kubernetes": "run as a Kubernetes Job (one node) or JobSet (several) on the stack's "
        "cluster, replaced by Kubernetes when a node is lost (kubectl from PATH); the default "
        "without -H on a stack of runMode jobs",
    },
)
def train(
    c: Invocation,
    gpus=None,
    nodes=1,
    set_=None,
    smoke=False,
    runtime="host",
    data="auto",
    allow_dirty=False,
    image=None,
    max_restarts=TrainOptions.max_restarts,
    min_gpus=None,
    master_port=TrainOptions.master_port,
    allow_public_master=False,
    resume=None,
    store=None,
    accept_new_host_key=False,
    spare=None,
    controller=None,
    controller_key=None,
    max_moves=RecoveryRule.max_moves,
    kubernetes=False,
):
    """Ship the commit and start a supervised training run, detached (survives disconnects)."""
    session.refuse_identity_after_task(sys.argv, "train")
    if resume:
        resume = checked_launch_id(resume, "--resume")  # it names folders on hosts and the store
    backend = _backend(
        c,
        kubernetes,
        runtime=runtime,
        failover=Failover(
            spare=spare,
            controller=controller,
            controller_key=controller_key,
            max_moves=parse_count(max_moves, "--max-moves"),
        ),
        accept_new_host_key=accept_new_host_key,
    )
    if resume:
        backend.resume(resume, _store(store))
        return
    if gpus is None and backend.default_gpus is None:
        raise LauncherError("--gpus: how many GPUs per node (0: CPU)")
    source = current_source(Path.cwd())
    options = make_options(
        gpus=parse_count(gpus, "--gpus") if gpus is not None else backend.default_gpus,
        nodes=parse_count(nodes, "--nodes"),
        sets=list(set_ or []),
        smoke=smoke,
        runtime=runtime,
        allow_dirty=allow_dirty,
        data=launch_mod.choose_data(source, data, _say),
        image=image,
        max_restarts=parse_count(max_restarts, "--max-restarts"),
        min_gpus=parse_count(min_gpus, "--min-gpus") if min_gpus is not None else None,
        master_port=parse_count(master_port, "--master-port"),
        allow_public_master=allow_public_master,
    )
    backend.launch(launch_mod.prepare(source, options, c.settings), options)


@all_hosts_task(
    help={
        "launch": LAUNCH_HELP,
        "run": RUN_HELP,
        "price_per_gpu_hour": "for the cost (default: the stack's cost.price_per_gpu_hour)",
        "from_store": "read the run from the run store, not a host" + FROM_STORE_DEFAULT,
        "store": STORE_HELP,
        "watch": "show it again every --interval seconds until the run has ended",
        "interval": "with --watch: seconds between two looks",
    }
)
def status(
    c: Invocation,
    run=None,
    price_per_gpu_hour=None,
    from_store=False,
    store=None,
    launch=None,
    watch_=False,
    interval=30,
):
    """Where the run stands: state, step, loss, ETA, cost, recall.

    Launch and run ids, state, step/total, loss, samples/s, ETA, elapsed, restarts, cost, sync
    lag, the recall once evaluated; an ended run's next step."""
    source = _run_source(c, _launch_flag(launch, run), from_store, store)
    price = None  # the stack's, if any
    if price_per_gpu_hour is not None:
        try:
            price = Decimal(str(price_per_gpu_hour))
        except InvalidOperation:
            raise LauncherError(
                f"--price-per-gpu-hour: a number, got {price_per_gpu_hour!r}"
            ) from None
    fab = session.fab_command(sys.argv)
    if watch_:
        watch.watch_status(source, price, _say, interval, fab)
    else:
        watch.show_status(source, price, _say, fab)


@all_hosts_task(
    help={
        "launch": LAUNCH_HELP,
        "run": RUN_HELP,
        "follow": "keep printing until the run ends",
        "lines": "lines of history to show first",
    }
)
def logs(c: Invocation, run=None, follow=False, lines=50, launch=None):
    """The run's output on every node: stage logs, and the supervisors' restart lines."""
    pairs, _ = _nodes(c, _launch_flag(launch, run))
    watch.show_logs(pairs, c.settings, parse_count(lines, "--lines"), follow, _say)


@all_hosts_task(
    help={
        "launch": LAUNCH_HELP,
        "run": RUN_HELP,
        "port": "local port of the forward",
        "from_store": "download the run's logs from the run store (into runs/ID/logs) and serve "
        "them here" + FROM_STORE_DEFAULT,
        "store": STORE_HELP,
    }
)
def tensorboard(c: Invocation, run=None, port=6006, from_store=False, store=None, launch=None):
    """TensorBoard on the run's logs, at a local URL it prints.

    Through an SSH port-forward to the host, or here, on the logs from the run store."""
    local_port = parse_count(port, "--port")
    source = _run_source(c, _launch_flag(launch, run), from_store, store)
    watch.tensorboard(source, local_port, _say)


@all_hosts_task(help={"launch": LAUNCH_HELP, "run": RUN_HELP})
def stop(c: Invocation, run=None, launch=None):
    """Graceful stop: every node checkpoints, then exits; the supervisor restarts nothing."""
    pairs, _ = _nodes(c, _launch_flag(launch, run))
    watch.stop(pairs, c.settings, _say, session.fab_command(sys.argv))


@all_hosts_task(
    help={
        "launch": LAUNCH_HELP,
        "run": RUN_HELP,
        "to": "local folder (default: runs/)",
        "push": "instead, `dvc push` the results from the host to the DVC remote",
        "from_store": "from the run store, not a host (the host may be gone)" + FROM_STORE_DEFAULT,
        "store": STORE_HELP,
    }
)
def fetch(
    c: Invocation, run=None, to="runs", push=False, from_store=False, store=None, launch=None
):
    """Bring the run's metrics, model, logs and DVC experiment here.

    Metrics (recall: eval.json), the exported model and logs into runs/ID, and the run's DVC
    experiment for `dvc exp show` (or, --push, the outputs pushed to the DVC remote)."""
    source = _run_source(c, _launch_flag(launch, run), from_store, store)
    if push:
        fetch_mod.push(source, c.settings, _say)
    else:
        fetch_mod.fetch(source, Path(to), current_source(Path.cwd()).root, _say)


@all_hosts_task(
    name="clean",
    help={
        "launch": "launch id (YYYYMMDD-HHMMSS-commit; default: the newest only)",
        "run": RUN_HELP,
        "all_": "every run on the hosts",
        "force": "remove runs whose newest checkpoint the run store lacks (also FORCE=1)",
    },
)
def clean_(c: Invocation, run=None, all_=False, force=False, launch=None):
    """Remove the newest run (or --launch, or --all) from the hosts.

    Finished or stopped ones only, never a running one, nor, without --force, one whose newest
    checkpoint the store lacks."""
    launch_id = _launch_flag(launch, run)
    hosts, _ = session.open_hosts(c.hosts, c.config, c.settings)
    chosen = [
        (h, watch.all_runs(h) if all_ else [session.launch_id_on(h, launch_id)]) for h in hosts
    ]
    if not (force or os.environ.get("FORCE") == "1"):
        unstored = [
            problem
            for host, runs in chosen
            for problem in watch.unstored_checkpoints(host, c.settings, runs)
        ]
        if unstored:
            raise LauncherError(
                "; ".join(unstored) + ": removing the run would lose it; let the store catch up "
                "(`fab status` shows the sync lag), or pass --force (FORCE=1); nothing was removed"
            )
    for host, runs in chosen:
        watch.clean(host, c.settings, runs, _say)
    if not (all_ or launch_id):
        fab = session.fab_command(sys.argv)
        _say(f"(the newest run only: {fab} clean --launch ID for another, --all for every run)")


def local_task(body=None, **task_options):
    """A task that acts here, on no host; a user error ends it with one line and exit 1."""

    def decorate(body):
        @functools.wraps(body)
        def run_here(c, *args, **options):
            try:
                return body(c, *args, **options)
            except UserError as exc:
                raise Exit(f"fab {body.__name__}: error: {exc}", code=1) from None

        return task(run_here, **task_options)

    return decorate(body) if body else decorate


@all_hosts_task(
    help={
        "run": "the run to repeat: a run folder (runs/<launch id> as `fab fetch` brought it) or "
        "a launch id, under runs/ or in the run store",
        "on": "where: user@host[:port][,...] (as -H; default: -H, or the stack's workers)",
        "kubernetes": "on the stack's cluster as a Job/JobSet (as `fab train --kubernetes`)",
        "allow_stack_change": "train even where the stack (Python, torch, DeepSpeed, ...) differs "
        "from the run's: the differences are logged, and results may differ",
        "store": "the run store of a run not under runs/ (default: storage.remote of params.yaml)",
        "accept_new_host_key": "record the key of a host never seen before (fresh hosts)",
    }
)
def rerun(
    c: Invocation,
    run,
    on=None,
    kubernetes=False,
    allow_stack_change=False,
    store=None,
    accept_new_host_key=False,
):
    """Repeat a finished run as a new launch, refused if its data or stack moved.

    Its commit, resolved params, options and runtime; its train stage first checks the data
    against the run's manifest and the stack against the run's, and refuses in one line when
    either moved."""
    if on:
        if c.hosts:
            raise LauncherError("--on HOST or -H HOST: give the hosts once")
        c = dataclasses.replace(c, hosts=controller_mod.parse_hosts(on, c.config))
    original = rerun_mod.find_original(run, _store(store))
    prepared, options = rerun_mod.plan(original, allow_stack_change, Path.cwd())
    if kubernetes or _jobs_stack(c):
        options = rerun_mod.on_cluster(options)
    backend = _backend(
        c, kubernetes, runtime=options.runtime, accept_new_host_key=accept_new_host_key
    )
    for line in rerun_mod.describe(original, prepared, options):
        _say(line)
    launch_id = backend.launch(prepared, options)
    _say(
        f"once it has finished: fab fetch --launch {launch_id}, then fab compare {run} {launch_id}"
    )


@local_task(
    help={
        "sort_by": "the metric that orders them, best first (default: mean_over_suites): any key "
        "of metrics/eval.json or train.json as `dvc exp show` names it (test.mean_recall, "
        "colour-shape.top1, val_loss: the lowest loss first)",
        "params": "under each run, its params where the runs differ (only those)",
        "folder": "where `fab fetch` put the runs (its --to; default: runs)",
    }
)
def runs(c, sort_by=runs_mod.DEFAULT_SORT, params=False, folder="runs"):
    """Every run here, best first: the demo, experiments and fetched runs.

    One row each (a fetched run by its launch id, marked smoke; an experiment by its name): each
    eval suite's headline number and the mean over suites, best first by --sort-by; then the
    commands that compare the top two (dvc plots diff, fab compare)."""
    repro.list_runs(sort_by, params, _say, Path(folder))


@local_task(
    help={
        "run_a": "a run folder (runs/<launch id> as `fab fetch` brought it, or a workspace) or "
        "a launch id under runs/",
        "run_b": "the other run, likewise",
        "tolerance": "absolute difference every metric may show when the weights are not "
        "bit-identical (default 0: bit-identical weights only)",
    }
)
def compare(c, run_a, run_b, tolerance="0"):
    """Two runs side by side, with a verdict (exit 0: the same, 1: different).

    Params, data and environment differences, metrics side by side, final weights; the same:
    identical, or within --tolerance."""
    if not repro.compare_runs(run_a, run_b, repro.parse_tolerance(tolerance), _say):
        raise Exit(code=1)


@local_task(
    help={
        "run": "a run folder (runs/<launch id>, a workspace) or a launch id under runs/",
        "to": "where: any fsspec URL (s3://bucket/models/name, ...) or a local folder",
    }
)
def publish(c, run, to):
    """Publish a run's model as one hub-style folder.

    The open_clip and transformers exports, the model card (environment, metrics, the
    `fab rerun` line), the run's record and a SHA256SUMS file."""
    repro.publish_run(run, to, _say)


@local_task(help={"url": "a published model (fab publish --to URL)", "to": "local folder"})
def pull(c, url, to):
    """Fetch a published model into a local folder, every file checked.

    Each file against the SHA256SUMS it came with; open_clip loads it as local-dir:FOLDER."""
    repro.pull_model(url, to, _say)


ns = Collection(
    check,
    train,
    status,
    logs,
    tensorboard,
    stop,
    fetch,
    clean_,
    rerun,
    runs,
    compare,
    publish,
    pull,
)
ns.configure({"clipforge": dict(SETTINGS)})

if __name__ == "__main__":
    sys.exit("run these tasks with `fab`, e.g. `fab --list`")
