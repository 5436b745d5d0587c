"""`fab train --kubernetes`: the Kubernetes backend (KubernetesJobs), driving kubectl.

The Kubernetes backend (KubernetesJobs), a run on the stack's cluster
as a Job (one node) or a JobSet (several), applied with `kubectl` from PATH. The objects
themselves are clipforge.launcher.kubernetes_objects' (pure); here are what reads the stack's
outputs, builds a launch's inputs (its record, plans and shipped commit) and runs kubectl.

Once Kubernetes' budget is spent (`--max-moves` replacements), `fab train --kubernetes --resume
ID` (`resubmit`) submits the launch the run store keeps again, under the same id, with a fresh
budget. On a stack of `runMode: jobs` (no SSH workers), `fab train` without -H comes here without
the flag.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from clipforge.errors import LauncherError
from clipforge.ids import new_launch_id
from clipforge.launcher import launch as launch_mod
from clipforge.launcher.backend import LaunchBackend
from clipforge.launcher.host.plan import PASSTHROUGH_ENV
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.kubernetes_objects import (
    FIELD_MANAGER,
    JOBSET_RELEASES,
    JOBSET_RESOURCE,
    RUN_FILES_MOUNT_PATH,
    Cluster,
    PodRun,
    WorkloadPhase,
    budget_from,
    master_address,
    node_plans,
    parse_cluster,
    pod_hosts,
    render,
    run_files,
    to_yaml,
    workload_name,
    workload_phase,
    workload_resource,
)
from clipforge.launcher.options import TrainOptions
from clipforge.launcher.recovery import RecoveryRule
from clipforge.launcher.run_source import RunSource, StoredRun
from clipforge.launcher.session import Settings
from clipforge.launcher.source import source_at, write_bundle
from clipforge.launcher.stack import LAUNCH_LABEL, jobs_stack_hint, runs_jobs


# -- the cluster, from the stack's outputs --------------------------------------------------------
def load_cluster(path: Path) -> Cluster:
    if not path.is_file():
        raise LauncherError(
            f"--kubernetes: no {path}; create the stack with `make up`, which writes it"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise LauncherError(f"{path}: not readable JSON ({exc}); rerun `make up`") from None
    return parse_cluster(raw, str(path))


def stack_runs_jobs(path: Path) -> bool:
    """Whether the stack `make up` wrote `path` for runs training as Jobs (runMode jobs), so that
    `fab train` without -H takes this path without --kubernetes. Only that key is read here: no
    outputs (no stack), or outputs this path cannot use, are the SSH path's to report."""
    try:
        return runs_jobs(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError):
        return False


def check_options(*, hosts: list, spare: str | None, runtime: str) -> None:
    """What `fab train --kubernetes` refuses, before anything is read or built."""
    if hosts:
        raise LauncherError(
            "--kubernetes runs on the stack's cluster (infra/stack-outputs.json), not on -H hosts"
        )
    if spare:
        raise LauncherError(
            "--kubernetes: no --spare: Kubernetes replaces a lost node itself, up to --max-moves"
        )
    if runtime != "host":
        raise LauncherError(
            "--kubernetes: the pod runs the image already; the stage runs on its Python "
            "(--runtime host)"
        )


def kubectl_argv(cluster: Cluster, *args: str) -> list[str]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise LauncherError(
            "--kubernetes: kubectl is not on PATH; install it "
            "(https://kubernetes.io/docs/tasks/tools/) with a kubeconfig for the stack's cluster"
        )
    context = ["--context", cluster.kube_context] if cluster.kube_context else []
    return [kubectl, *context, "--namespace", cluster.namespace, *args]


def _kubectl(cluster: Cluster, *args: str, stdin: str | None = None) -> str:
    argv = kubectl_argv(cluster, *args)
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if result.returncode != 0:
        raise LauncherError(
            f"`kubectl {' '.join(args[:2])}` failed: {result.stderr.strip() or result.stdout}"
        )
    return result.stdout


def require_jobset(cluster: Cluster) -> None:
    """Several nodes need the JobSet CRD and controller on the cluster (not part of Kubernetes)."""
    # Discovery, which every user may read (a CRD object itself is cluster-scoped).
    found = _kubectl(cluster, "api-resources", "--api-group=jobset.x-k8s.io", "-o", "name")
    if JOBSET_RESOURCE not in found.split():
        raise LauncherError(
            f"--nodes > 1 with --kubernetes needs JobSet ({JOBSET_RESOURCE}), which the cluster "
            f"lacks: install its release manifest (`kubectl apply --server-side -f "
            f"{JOBSET_RELEASES}/download/<version>/manifests.yaml`, cluster admin), or train on "
            f"one node (--nodes 1)"
        )


def apply(cluster: Cluster, objects: list[dict]) -> str:
    """`kubectl apply --server-side -f -`: server-side, because a client-side apply copies each
    object into an annotation (256 KiB at most), which a piece of the bundle would not fit."""
    return _kubectl(
        cluster,
        "apply",
        "--server-side",
        f"--field-manager={FIELD_MANAGER}",
        "-f",
        "-",
        stdin=to_yaml(objects),
    )


def build(
    cluster: Cluster,
    prepared: launch_mod.Prepared,
    options: TrainOptions,
    settings: Settings,
    max_moves: int,
    environ: Mapping[str, str],
    run_files_mount: str = RUN_FILES_MOUNT_PATH,
    launch_id: str | None = None,
) -> tuple[str, list[dict]]:
    """A launch of `prepared` on the cluster: its id and its objects; a new launch, or
    `launch_id` submitted again (`--resume`). The budget is the recovery rule of the settings
    (`gone_after_seconds`) and `--max-moves`, as for `fab train --spare`; the secrets are
    PASSTHROUGH_ENV's values in `environ`, as the SSH path's."""
    rule = RecoveryRule(
        probe_every_seconds=settings.probe_every_seconds,
        gone_after_misses=settings.gone_after_misses,
        gone_after_seconds=settings.gone_after_seconds,
        max_moves=max_moves,
    )
    launch_id = launch_id or new_launch_id(prepared.source.commit)
    layout = NodeLayout(root=cluster.run_root, launch_id=launch_id, node_rank=0)
    several = options.nodes > 1
    record = launch_mod.run_record(
        launch_id,
        prepared,
        options,
        pod_hosts(launch_id, options.nodes),
        checkpoints_dir=layout.shared_checkpoints if several else layout.output("checkpoints"),
        master=f"{master_address(launch_id)}:{options.master_port}" if several else None,
        interfaces=None,
        user=None,
    )
    plans = node_plans(
        options,
        cluster,
        launch_id,
        prepared.image,
        launch_mod.restart_policy(options, settings),
        settings.shm_size,
        init_dvc=prepared.source.show(".dvc/config") is None,
    )
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "code.bundle"
        write_bundle(prepared.source, bundle)
        run = PodRun(
            launch_id=launch_id,
            commit=prepared.source.commit,
            image=prepared.image,
            nodes=options.nodes,
            gpus_per_node=options.gpus,
            files=run_files(launch_id, record.to_json(), prepared.params_yaml, options, plans),
            bundle=bundle.read_bytes(),
            env={name: environ[name] for name in PASSTHROUGH_ENV if name in environ},
            stop_timeout_seconds=math.ceil(settings.stop_timeout_seconds),
            run_files_mount=run_files_mount,
        )
    return launch_id, render(run, cluster, budget_from(rule), launch_mod.clone_command)


def launch(
    cluster: Cluster,
    prepared: launch_mod.Prepared,
    options: TrainOptions,
    settings: Settings,
    max_moves: int,
    say: Callable[[str], None],
    environ: Mapping[str, str],
) -> str:
    """`fab train --kubernetes`: build the run and apply it; returns its launch id."""
    _require_kubectl(cluster, options.nodes)
    launch_id, objects = build(cluster, prepared, options, settings, max_moves, environ)
    _submit(cluster, launch_id, objects, options, prepared, say)
    return launch_id


def _require_kubectl(cluster: Cluster, nodes: int) -> None:
    """kubectl is there (and JobSet, for several nodes), before anything is built."""
    if nodes > 1:
        require_jobset(cluster)
    else:
        kubectl_argv(cluster)


def _submit(
    cluster: Cluster,
    launch_id: str,
    objects: list[dict],
    options: TrainOptions,
    prepared: launch_mod.Prepared,
    say: Callable[[str], None],
) -> None:
    kind = objects[-1]["kind"]
    say(
        f"applying {kind} {workload_name(launch_id)} ({options.nodes} node(s)) in namespace "
        f"{cluster.namespace}"
        + (f", context {cluster.kube_context}" if cluster.kube_context else "")
    )
    say(apply(cluster, objects).rstrip())
    selector = f"-l {LAUNCH_LABEL}={launch_id}"
    say(
        f"started run {launch_id} on the cluster; watch it: `kubectl -n {cluster.namespace} get "
        f"{kind.lower()}s,pods {selector}`, `kubectl -n {cluster.namespace} logs -f {selector}`"
        + (f", `fab status --from-store --launch {launch_id}`" if prepared.store else "")
    )


# -- `--resume`: the run submitted again, once Kubernetes' budget is spent ----------------------
def resubmit(
    cluster: Cluster,
    launch_id: str,
    remote: str | None,
    settings: Settings,
    max_moves: int,
    say: Callable[[str], None],
    environ: Mapping[str, str],
) -> None:
    """`fab train --kubernetes --resume ID`: the run's launch as the run store keeps it
    (launches/ID.json, as `fab -H HOST train --resume ID` reads it), submitted again under the
    same launch id with a fresh budget (`--max-moves`). Its pods find the run's directory on the
    checkpoints volume, and the train stage resumes the same training run (its id follows from
    the same commit and params) from the newest checkpoint there or in the store.

    Refused while the previous submission is still active (Kubernetes still resumes it: two
    would write one run) or once it completed. A failed one is deleted first, with its files:
    the new objects have the same names, and ConfigMaps are immutable. Its pods are not waited
    for, since one on a lost node may never go (the run store's lease keeps one writer)."""
    stored = StoredRun.open(remote, launch_id)
    record = stored.record()
    options = launch_mod.stored_options(record)
    if options.runtime != "host":
        # A run launched over SSH in the image: the pod is that image, the stage its Python.
        say(f"run {launch_id} ran with --runtime {options.runtime}; in a pod it is the image's")
        options = replace(options, runtime="host")
    _require_kubectl(cluster, options.nodes)
    resource, name = workload_resource(options.nodes), workload_name(launch_id)
    found = _kubectl(cluster, "get", resource, name, "--ignore-not-found", "-o", "json")
    if found.strip():
        previous = json.loads(found)
        kind = previous.get("kind", "Job")
        phase = workload_phase(previous)
        where = f"`kubectl -n {cluster.namespace} get {resource} {name}`"
        if phase is WorkloadPhase.ACTIVE:
            raise LauncherError(
                f"run {launch_id}: its {kind} {name} is still active ({where}): Kubernetes "
                f"resumes it itself while its budget lasts; to submit it again anyway, stop it "
                f"first (`kubectl -n {cluster.namespace} delete {resource} {name}`)"
            )
        if phase is WorkloadPhase.COMPLETE:
            raise LauncherError(
                f"run {launch_id}: its {kind} {name} has completed ({where}); nothing to resume"
            )
    prepared = replace(  # a rerun's stays one (its record's `repeats`)
        launch_mod.prepare(source_at(Path.cwd(), record.commit), options, settings),
        repeats=record.repeats,
    )
    _, objects = build(
        cluster, prepared, options, settings, max_moves, environ, launch_id=launch_id
    )
    if found.strip():
        say(f"deleting the failed {name} and its files (not waiting for its pods)")
        # A JobSet's own Jobs carry the launch's label too: they go with it, not after it.
        kinds = ",".join(dict.fromkeys([resource, "jobs.batch", "configmaps", "secrets"]))
        _kubectl(cluster, "delete", kinds, "-l", f"{LAUNCH_LABEL}={launch_id}", "--wait=true")
    say(
        f"resubmitting run {launch_id} (training run {stored.store.run_id}, commit "
        f"{record.commit[:10]}, last on {record.host}) from {remote}, with a budget of "
        f"{max_moves} move(s)"
    )
    _submit(cluster, launch_id, objects, options, prepared, say)


class KubernetesJobs(LaunchBackend):
    """A launch as a Job (one node) or JobSet (several) on the stack's cluster."""

    def __init__(
        self,
        cluster: Cluster,
        settings: Settings,
        say: Callable[[str], None],
        max_moves: int,
        environ: Mapping[str, str],
    ):
        self.cluster = cluster
        self.settings = settings
        self.say = say
        self.max_moves = max_moves
        self.environ = environ

    @property
    def default_gpus(self) -> int | None:
        return self.cluster.gpus_per_node

    def launch(self, prepared: launch_mod.Prepared, options: TrainOptions) -> str:
        return launch(
            self.cluster, prepared, options, self.settings, self.max_moves, self.say, self.environ
        )

    def holds(self, launch_id: str) -> bool:
        """Whether its Job or JobSet is on the cluster (either, not knowing its node count)."""
        return any(
            _kubectl(
                self.cluster, "get", resource, workload_name(launch_id), "--ignore-not-found"
            ).strip()
            for resource in (workload_resource(1), workload_resource(2))
        )

    def resume(self, launch_id: str, store: str | None) -> None:
        """Its workload, its budget spent, submitted again from the run store (`resubmit`)."""
        self._resubmit(launch_id, store)

    def move(self, launch_id: str, store: str | None) -> None:
        """A launch the cluster does not have (launched elsewhere, or deleted), submitted from
        the run store (`resubmit`)."""
        self._resubmit(launch_id, store)

    def _resubmit(self, launch_id: str, store: str | None) -> None:
        resubmit(
            self.cluster, launch_id, store, self.settings, self.max_moves, self.say, self.environ
        )

    def status(self, launch_id: str | None, store: str | None) -> RunSource:
        """A Job's pod is no host to ask: the run is read from its run store."""
        if not (launch_id and store):
            raise LauncherError(jobs_stack_hint(self.cluster.namespace, launch_id))
        return StoredRun.open(store, launch_id)
