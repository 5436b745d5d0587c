"""The Kubernetes objects of a run (a Job or a JobSet), rendered from typed inputs.

The objects of a run on the stack's cluster, as Kubernetes' own workload: a batch/v1 Job (one
node) or a JobSet (several), whose pods run the supervisor over the launch's plan. Pure: objects
from typed inputs (the cluster, the run, the budget), no I/O, standard library + yaml; the backend
that builds the inputs and applies the objects with kubectl is clipforge.launcher.kubernetes.

Why Kubernetes' semantics and not a controller of ours (docs/launcher.md, "On the Kubernetes
stack"): the node lifecycle controller already decides that a node is gone (its kubelet missed
heartbeats for the grace period: taint `node.kubernetes.io/unreachable` or `not-ready`), and a
pod leaves it after its `tolerationSeconds` for that taint, which we set from the recovery rule's
`gone_after_seconds`. A Job then starts a replacement pod, up to `backoffLimit` (`--max-moves`); a
JobSet restarts all its nodes together, up to `failurePolicy.maxRestarts` (`--max-moves`): a
DeepSpeed world cannot go on with one node missing. That is what Kubeflow's Trainer v2 builds on,
and nothing of ours has to run beside the run. A replacement pod finds the run's directory on the
retained checkpoints volume (ReadWriteMany) and the supervisor's state there; the train stage
resumes from the newest checkpoint, local or the run store's.

`podReplacementPolicy: TerminatingOrFailed`, not `Failed`: a pod on a lost node never reaches
phase Failed (the kubelet that would say so is gone, and the pod garbage collector only forces
pods off deleted nodes or nodes tainted `out-of-service`), so with `Failed` the Job would wait
for a person, as the stack's StatefulSet does. For the same reason there is no
`podFailurePolicy` (it requires `Failed`). The cost: the old pod may still be alive behind a
partition while its replacement starts. The run store's lease keeps one writer (docs/faults.md,
"One run, one writer"), and a pod cut off from the API server is usually cut off from the
volume's network too.

What the pod runs is the SSH path's: the plan of clipforge.launcher.commands.node_plan, the
checkout made by launch.clone_command, the supervisor of clipforge.launcher.host.supervisor
(`run`, in the foreground: the pod is its session).
"""

from __future__ import annotations

import base64
import enum
import math
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from clipforge.errors import LauncherError
from clipforge.launcher.commands import IMAGE_PYTHON, NodeContext, hostfile_text, node_plan
from clipforge.launcher.connection import q
from clipforge.launcher.host.plan import RestartPolicy
from clipforge.launcher.host.run_dirs import DEFAULT_ROOT, NODE_PREFIX, NodeLayout
from clipforge.launcher.options import TrainOptions
from clipforge.launcher.recovery import RecoveryRule
from clipforge.launcher.stack import LAUNCH_LABEL, runs_jobs

# The stack's fixed names and ids (infra/clipforge_infra/contract.py is their home; the launcher
# does not import infra/, and tests/launcher/test_kubernetes.py checks these agree with it).
ALERTS_SECRET = "clipforge-alerts"
REGISTRY_SECRET = "clipforge-registry"
RUN_COMPONENT = "run"  # the label the stack's NetworkPolicy for run pods selects
RUN_AS_UID = 1000
RUN_AS_GID = 1000
SHM_MOUNT_PATH = "/dev/shm"

RUN_FILES_MOUNT_PATH = "/etc/clipforge/run"
# A ConfigMap holds at most 1 MiB; the shipped commit (a git bundle) is split into pieces below.
BUNDLE_CHUNK_BYTES = 768 * 1024
BUNDLE_CHUNK = "code.bundle."
JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
JOBSET_RESOURCE = "jobsets.jobset.x-k8s.io"
JOBSET_RELEASES = "https://github.com/kubernetes-sigs/jobset/releases"
REPLICATED_JOB = "node"
CONTAINER = "node"
FIELD_MANAGER = "clipforge-launcher"
# The taints the node lifecycle controller puts on a node whose kubelet stopped reporting.
NODE_LOST_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


# -- the cluster, from the stack's outputs --------------------------------------------------------
@dataclass(frozen=True)
class Volume:
    role: str  # datasets, checkpoints, logs
    claim: str
    mount_path: str


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Where a run's pods go and what they get, as infra/stack-outputs.json says."""

    namespace: str
    kube_context: str | None
    gpu_resource_name: str
    gpus_per_node: int
    volumes: tuple[Volume, ...]
    # The workers' scheduling, when the outputs carry it (docs/launcher.md: the keys the stack
    # should write); absent: the pods ask for their GPUs only and tolerate no GPU taint.
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    cpu: str | None = None
    memory: str | None = None
    shm_size: str | None = None
    # runMode jobs: the stack has no SSH workers, and `fab train` without -H comes here.
    runs_jobs: bool = False

    def mount(self, role: str) -> str:
        return next(v.mount_path for v in self.volumes if v.role == role)

    @property
    def run_root(self) -> str:
        """The runs' root on the retained checkpoints volume, as the SSH path's on the stack
        (session.root_setting), where `make down`'s guard looks for checkpoints."""
        return posixpath.join(self.mount("checkpoints"), DEFAULT_ROOT)


def parse_cluster(raw: Any, source: str) -> Cluster:
    """The outputs (`pulumi stack output --json`) a Kubernetes run needs, checked key by key. A
    released stack (`make down`) is fine: its volumes and secrets stay, and its GPUs are free."""

    def fail(key: str, value: Any) -> LauncherError:
        return LauncherError(
            f"{source}: `{key}` missing or malformed (got {value!r}); rerun `make up` (the "
            f"launcher and infra/ may be out of step)"
        )

    if not isinstance(raw, dict):
        raise LauncherError(f"{source}: expected a JSON object; rerun `make up`")
    namespace, context = raw.get("namespace"), raw.get("kube_context")
    if not isinstance(namespace, str) or not namespace:
        raise fail("namespace", namespace)
    if context is not None and not isinstance(context, str):
        raise fail("kube_context", context)
    gpu_name, gpus = raw.get("gpu_resource_name"), raw.get("gpus_per_worker")
    if not isinstance(gpu_name, str) or not gpu_name:
        raise fail("gpu_resource_name", gpu_name)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise fail("gpus_per_worker", gpus)
    volumes_raw = raw.get("volumes")
    if not isinstance(volumes_raw, dict) or "checkpoints" not in volumes_raw:
        raise fail("volumes.checkpoints", volumes_raw)
    volumes = []
    for role, spec in sorted(volumes_raw.items()):
        claim = spec.get("claim") if isinstance(spec, dict) else None
        mount = spec.get("mount_path") if isinstance(spec, dict) else None
        if not isinstance(claim, str) or not isinstance(mount, str) or not mount.startswith("/"):
            raise fail(f"volumes.{role}", spec)
        volumes.append(Volume(role=role, claim=claim, mount_path=mount))
    selector = raw.get("gpu_node_selector") or {}
    if not isinstance(selector, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in selector.items()
    ):
        raise fail("gpu_node_selector", selector)
    tolerations = raw.get("gpu_tolerations") or []
    if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
        raise fail("gpu_tolerations", tolerations)
    sizes = {}
    for key in ("cpu_per_worker", "memory_per_worker", "shm_size"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise fail(key, value)
        sizes[key] = value
    return Cluster(
        namespace=namespace,
        kube_context=context or None,
        gpu_resource_name=gpu_name,
        gpus_per_node=gpus,
        volumes=tuple(volumes),
        node_selector=dict(selector),
        tolerations=tuple(tolerations),
        cpu=sizes["cpu_per_worker"],
        memory=sizes["memory_per_worker"],
        shm_size=sizes["shm_size"],
        runs_jobs=runs_jobs(raw),
    )


# -- the budget: the recovery rule in Kubernetes' terms -------------------------------------------
@dataclass(frozen=True)
class Budget:
    max_moves: int
    """Job `backoffLimit` (one node) or JobSet `failurePolicy.maxRestarts` (several)."""
    toleration_seconds: int
    """How long a pod stays on a node tainted unreachable/not-ready before it is evicted."""


def budget_from(rule: RecoveryRule) -> Budget:
    """`gone_after_seconds` becomes the pods' tolerationSeconds (Kubernetes' default, added by
    the DefaultTolerationSeconds admission plugin, is 300). The k misses are the kubelet's
    heartbeats within the cluster's node-monitor-grace-period, a cluster setting, not a pod's:
    a node is left `grace period + gone_after_seconds` after its last heartbeat."""
    return Budget(max_moves=rule.max_moves, toleration_seconds=math.ceil(rule.gone_after_seconds))


# -- what one run is made of ---------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PodRun:
    launch_id: str
    commit: str
    image: str
    nodes: int
    gpus_per_node: int  # 0: CPU ranks, no GPU request
    files: Mapping[str, str]  # run files by name (see run_files), mounted read-only
    bundle: bytes  # the shipped commit (a git bundle)
    env: Mapping[str, str]  # PASSTHROUGH_ENV values: they go into the run's Secret only
    stop_timeout_seconds: int
    run_files_mount: str = RUN_FILES_MOUNT_PATH


def workload_name(launch_id: str) -> str:
    """The Job's (JobSet's) name, prefix of every object of the run; a DNS label."""
    return f"clipforge-{launch_id}".lower()


def jobset_host(launch_id: str, rank: int) -> str:
    """Node `rank`'s pod host name in the JobSet: <jobset>-<replicated job>-<job index>-<pod
    index>, in the subdomain of the headless Service the JobSet controller creates."""
    name = workload_name(launch_id)
    return f"{name}-{REPLICATED_JOB}-0-{rank}.{name}"


def master_address(launch_id: str) -> str:
    """The rendezvous of several nodes: pod 0."""
    return jobset_host(launch_id, 0)


def plan_file(rank: int | str) -> str:
    """Node `rank`'s plan among the run files (the pod's script passes "$rank")."""
    return f"plan-{rank}.json"


def run_files(
    launch_id: str,
    record_json: str,
    params_yaml: str,
    options: TrainOptions,
    plans: list[str],
) -> dict[str, str]:
    """The files every pod of the run gets (by name): run.json and params.resolved.yaml for the
    run directory, each node's plan, and (several nodes) DeepSpeed's hostfile."""
    layout = NodeLayout(root="/", launch_id=launch_id, node_rank=0)
    files = {
        posixpath.basename(layout.record): record_json,
        posixpath.basename(layout.resolved_params): params_yaml,
    }
    if options.nodes > 1:
        hosts = pod_hosts(launch_id, options.nodes)
        files[posixpath.basename(layout.hostfile)] = hostfile_text(hosts, max(options.gpus, 1))
    files.update({plan_file(rank): plan for rank, plan in enumerate(plans)})
    return files


def pod_hosts(launch_id: str, nodes: int) -> list[str]:
    """The nodes as the run record names them: each pod's JobSet host name, or the Job's name."""
    if nodes == 1:
        return [workload_name(launch_id)]
    return [jobset_host(launch_id, rank) for rank in range(nodes)]


def node_plans(
    options: TrainOptions,
    cluster: Cluster,
    launch_id: str,
    image: str,
    policy: RestartPolicy,
    shm_size: str,
    init_dvc: bool,
) -> list[str]:
    """Each node's plan.json, built as the SSH path builds it: the stage on the image's Python
    (`--runtime host` inside the pod), node 0 the rendezvous."""
    master = master_address(launch_id) if options.nodes > 1 else ""
    hosts = pod_hosts(launch_id, options.nodes)
    return [
        node_plan(
            options,
            NodeContext(
                layout=NodeLayout(root=cluster.run_root, launch_id=launch_id, node_rank=rank),
                hosts=hosts,
                master_addr=master,
                host_python=IMAGE_PYTHON,
                user="",
                image=image,
                shm_size=shm_size,
            ),
            policy,
            init_dvc=init_dvc,
        ).to_json()
        for rank in range(options.nodes)
    ]


def bundle_chunks(bundle: bytes) -> dict[str, bytes]:
    """The bundle in pieces that each fit a ConfigMap; names sort in order."""
    count = max(1, math.ceil(len(bundle) / BUNDLE_CHUNK_BYTES))
    return {
        f"{BUNDLE_CHUNK}{index:03d}": bundle[
            index * BUNDLE_CHUNK_BYTES : (index + 1) * BUNDLE_CHUNK_BYTES
        ]
        for index in range(count)
    }


_POD_SCRIPT = """\
set -eu
rank="${{JOB_COMPLETION_INDEX:-0}}"
run_dir={run_dir}
files={files}
node="$run_dir/{node_prefix}$rank"
mkdir -p "$node"
# The first pod of this node ships the commit; a replacement finds it on the volume.
if [ ! -d "$node/code" ]; then
  rm -rf "$node/code.tmp"
  cat "$files"/{chunk}* > "$node/code.bundle"
  {clone}
  mv "$node/code.tmp" "$node/code"
fi
for name in {run_dir_files}; do
  if [ -e "$files/$name" ]; then
    cp "$files/$name" "$run_dir/.$name.$rank" && mv "$run_dir/.$name.$rank" "$run_dir/$name"
  fi
done
cp "$files/{plan}" "$node/.plan.json" && mv "$node/.plan.json" {plan_json}
{shared}cd "$node"
export PYTHONPATH="$node/code/src"
exec {python} -m clipforge.launcher.host.supervisor run "$node"
"""


def pod_args(run: PodRun, run_root: str, clone: Callable[[str, str, str], str]) -> list[str]:
    """The container's command: make this node's directory (once), then the supervisor over its
    plan. `clone` is launch.clone_command: the SSH path's checkout, not a second one."""
    layout = NodeLayout(root=run_root, launch_id=run.launch_id, node_rank=0)
    plans = {plan_file(rank) for rank in range(run.nodes)}
    in_run_dir = sorted(name for name in run.files if name not in plans)
    shared = f"mkdir -p {q(layout.shared_checkpoints)}\n" if run.nodes > 1 else ""
    script = _POD_SCRIPT.format(
        run_dir=q(layout.run_dir),
        files=q(run.run_files_mount),
        node_prefix=NODE_PREFIX,
        chunk=BUNDLE_CHUNK,
        clone=clone('"$node/code.bundle"', '"$node/code.tmp"', run.commit),
        run_dir_files=" ".join(q(name) for name in in_run_dir),
        shared=shared,
        plan=plan_file("$rank"),
        plan_json=f'"$node"/{posixpath.basename(layout.plan)}',
        python=IMAGE_PYTHON,
    )
    return ["sh", "-c", script, "clipforge-pod"]


# -- the objects ---------------------------------------------------------------------------------
def labels(launch_id: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "clipforge",
        "app.kubernetes.io/component": RUN_COMPONENT,
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        LAUNCH_LABEL: launch_id,
    }


def render(
    run: PodRun, cluster: Cluster, budget: Budget, clone: Callable[[str, str, str], str]
) -> list[dict]:
    """Every object of the run, in the order to apply them: its files (ConfigMaps), its secrets
    (a Secret), then the Job or the JobSet."""
    name = workload_name(run.launch_id)
    meta = {"namespace": cluster.namespace, "labels": labels(run.launch_id)}
    chunks = bundle_chunks(run.bundle)
    config_maps: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-files", **meta},
            "immutable": True,
            "data": dict(run.files),
        }
    ] + [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-code-{index}", **meta},
            "immutable": True,
            "binaryData": {key: base64.b64encode(piece).decode("ascii")},
        }
        for index, (key, piece) in enumerate(chunks.items())
    ]
    secret: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-env", **meta},
        "type": "Opaque",
        "stringData": {key: run.env[key] for key in sorted(run.env)},
    }
    pod = {
        "metadata": {"labels": labels(run.launch_id)},
        "spec": pod_spec(run, cluster, budget, clone, [c["metadata"]["name"] for c in config_maps]),
    }
    workload: dict[str, Any]
    if run.nodes == 1:
        workload = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, **meta},
            "spec": {
                "completions": 1,
                "parallelism": 1,
                "backoffLimit": budget.max_moves,
                "podReplacementPolicy": "TerminatingOrFailed",
                "template": pod,
            },
        }
    else:
        workload = {
            "apiVersion": JOBSET_API_VERSION,
            "kind": "JobSet",
            "metadata": {"name": name, **meta},
            "spec": {
                # Any node's pod failing fails its Job at once (backoffLimit 0), and the JobSet
                # restarts every node together, from the same checkpoint.
                "failurePolicy": {"maxRestarts": budget.max_moves, "restartStrategy": "Recreate"},
                # The JobSet controller creates the headless Service `name` for these host names.
                # Only Ready pods are published: a pod stuck Terminating on a lost node keeps
                # its host name, and must not answer for its replacement.
                "network": {
                    "enableDNSHostnames": True,
                    "subdomain": name,
                    "publishNotReadyAddresses": False,
                },
                "replicatedJobs": [
                    {
                        "name": REPLICATED_JOB,
                        "replicas": 1,
                        "template": {
                            "metadata": {"labels": labels(run.launch_id)},
                            "spec": {
                                "completionMode": "Indexed",
                                "completions": run.nodes,
                                "parallelism": run.nodes,
                                "backoffLimit": 0,
                                "podReplacementPolicy": "TerminatingOrFailed",
                                "template": pod,
                            },
                        },
                    }
                ],
            },
        }
    return [*config_maps, secret, workload]


def pod_spec(
    run: PodRun,
    cluster: Cluster,
    budget: Budget,
    clone: Callable[[str, str, str], str],
    config_maps: list[str],
) -> dict:
    """The workers' pod (infra/clipforge_infra/components/workers.py: volumes, /dev/shm, the
    alert webhooks, security, one node each) running the run instead of sshd: no SSH keys and
    no port, since nothing connects to it (DeepSpeed's launcher runs in no-SSH mode)."""
    resources: dict[str, str] = {}
    if run.gpus_per_node:
        resources[cluster.gpu_resource_name] = str(run.gpus_per_node)
    if cluster.cpu:
        resources["cpu"] = cluster.cpu
    if cluster.memory:
        resources["memory"] = cluster.memory
    shm: dict[str, Any] = {"medium": "Memory"}
    if cluster.shm_size:
        shm["sizeLimit"] = cluster.shm_size
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": run.image,
        # the image's entrypoint reports the stack, then execs these
        "args": pod_args(run, cluster.run_root, clone),
        "env": [
            {"name": f"CLIPFORGE_{v.role.upper()}_DIR", "value": v.mount_path}
            for v in cluster.volumes
        ],
        # The stack's alert webhooks, then the launch's own secrets (a later source wins, as the
        # values `fab train` hands a supervisor over SSH win over a worker's).
        "envFrom": [
            {"secretRef": {"name": ALERTS_SECRET, "optional": True}},
            {"secretRef": {"name": f"{workload_name(run.launch_id)}-env"}},
        ],
        "volumeMounts": [{"name": v.role, "mountPath": v.mount_path} for v in cluster.volumes]
        + [
            {"name": "dshm", "mountPath": SHM_MOUNT_PATH},
            {"name": "run-files", "mountPath": run.run_files_mount, "readOnly": True},
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if resources:
        # Requests equal limits: Guaranteed QoS when cpu and memory are known, as the workers.
        container["resources"] = {"requests": resources, "limits": dict(resources)}
    tolerations = [dict(t) for t in cluster.tolerations] + [
        {
            "key": taint,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": budget.toleration_seconds,
        }
        for taint in NODE_LOST_TAINTS
    ]
    spec: dict[str, Any] = {
        # A pod never restarts in place: its supervisor restarts crashed phases itself, and a
        # pod that ended failed is replaced on a node that may be another (the budget above).
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            {"name": v.role, "persistentVolumeClaim": {"claimName": v.claim}}
            for v in cluster.volumes
        ]
        + [
            {"name": "dshm", "emptyDir": shm},
            {
                "name": "run-files",
                "projected": {"sources": [{"configMap": {"name": n}} for n in config_maps]},
            },
        ],
        "tolerations": tolerations,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_UID,
            "runAsGroup": RUN_AS_GID,
            "fsGroup": RUN_AS_GID,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # The stack's pull credentials when it has them; the kubelet goes on without a missing one.
        "imagePullSecrets": [{"name": REGISTRY_SECRET}],
        "automountServiceAccountToken": False,
        # What a graceful stop (`kubectl delete`) gives the supervisor to checkpoint.
        "terminationGracePeriodSeconds": run.stop_timeout_seconds,
    }
    if cluster.node_selector:
        spec["nodeSelector"] = dict(cluster.node_selector)
    if run.nodes > 1:
        # One node per pod, as the workers: the GPUs per node are what the hostfile says.
        spec["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {LAUNCH_LABEL: run.launch_id}},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        }
    return spec


def to_yaml(objects: list[dict]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False)


# -- a run's workload, as the API server returns it ---------------------------------------------
class WorkloadPhase(enum.Enum):
    """Where a run's Job (JobSet) stands, by its status conditions."""

    ACTIVE = "active"  # running, or replacing a pod: Kubernetes is still at it
    COMPLETE = "complete"
    FAILED = "failed"  # its budget spent (or another failure): only a new submission goes on


# A condition's type that ends the workload, by what it means. FailureTarget and
# SuccessCriteriaMet come first on a Job (Kubernetes >= 1.31), which is Failed (Complete) only
# once its pods are gone, and a pod left on a lost node may never be: the first word counts.
_ENDING_CONDITIONS = {
    "Complete": WorkloadPhase.COMPLETE,
    "SuccessCriteriaMet": WorkloadPhase.COMPLETE,
    "Completed": WorkloadPhase.COMPLETE,  # a JobSet's
    "Failed": WorkloadPhase.FAILED,  # a Job's and a JobSet's
    "FailureTarget": WorkloadPhase.FAILED,
}


def workload_phase(workload: Mapping[str, Any]) -> WorkloadPhase:
    """The phase of a Job or JobSet as the API server returns it (`kubectl get -o json`)."""
    status = workload.get("status") or {}
    for condition in status.get("conditions") or []:
        phase = _ENDING_CONDITIONS.get(condition.get("type"))
        if phase is not None and condition.get("status") == "True":
            return phase
    return WorkloadPhase.ACTIVE


def workload_resource(nodes: int) -> str:
    """The kubectl resource of a run's workload: batch/v1 Jobs, or JobSets for several nodes."""
    return "jobs.batch" if nodes == 1 else JOBSET_RESOURCE
