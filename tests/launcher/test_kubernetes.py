"""`fab train --kubernetes`: the Job (one node) or JobSet (several) a run becomes, rendered from
the outputs the stack really writes and a real launch of the project; every object valid for the
API server; the recovery policy's numbers in Kubernetes' fields; `kubectl` from PATH (a stand-in
that records what it is given: no cluster runs here)."""

from __future__ import annotations

import base64
import copy
import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from clipforge.errors import LauncherError
from clipforge.launcher import kubernetes as kube
from clipforge.launcher import kubernetes_objects as k8s_objects
from clipforge.launcher.commands import dvc_train_argv
from clipforge.launcher.host.plan import PhasePlan
from clipforge.launcher.launch import prepare
from clipforge.launcher.options import make_options
from clipforge.launcher.session import Settings
from clipforge.launcher.source import current_source
from clipforge.launcher.stack import LAUNCH_LABEL
from clipforge.store.remote import RunStore
from tests.conftest import REPO
from tests.launcher.conftest import make_fab

sys.path.insert(0, str(REPO / "tests" / "infra"))
from infra_harness import program_values, run_program, stack_config  # noqa: E402  (puts infra/ on sys.path)

from clipforge_infra import contract  # noqa: E402
from clipforge_infra.settings import parse_settings  # noqa: E402
from clipforge_infra.stack_outputs import describe_stack  # noqa: E402

KUBERNETES_VERSION = "1.33.0"  # as tests/infra: a current release, strict
JOBSET_SPEC_SCHEMA = json.loads(
    (REPO / "tests" / "support" / "jobset_v1alpha2_spec.schema.json").read_text()
)
IMAGE = "registry.example/clipforge:test"
SETTINGS = Settings(
    remote_root=None,
    python="python3",
    stack_outputs=Path("infra/stack-outputs.json"),
    min_free_gb=1,
    backoff_seconds=1,
    backoff_max_seconds=2,
    stop_timeout_seconds=180,
    shm_size="16g",
    registry=None,
)


def stack_outputs(stack: str = "example-2x8", **overrides) -> dict:
    """infra/stack-outputs.json as `make up` writes it for that example stack."""
    config, secret_keys = stack_config(stack, overrides)
    settings = parse_settings(program_values(config, secret_keys), secret_keys)
    outputs = describe_stack(settings, settings.namespace, "ssh-ed25519 AAAA host")
    return json.loads(json.dumps(outputs))


@pytest.fixture(scope="module")
def cluster() -> k8s_objects.Cluster:
    return k8s_objects.parse_cluster(stack_outputs(), "stack-outputs.json")


def options_for(nodes: int = 1, gpus: int = 8, sets: tuple[str, ...] = ()):
    return make_options(
        gpus=gpus,
        nodes=nodes,
        sets=list(sets),
        smoke=False,
        runtime="host",
        allow_dirty=False,
        data="build",
        image=IMAGE,
    )


def build(project, cluster, *, nodes=1, gpus=8, max_moves=2, settings=SETTINGS, environ=None):
    options = options_for(nodes, gpus)
    prepared = prepare(current_source(project), options, settings)
    return kube.build(cluster, prepared, options, settings, max_moves, environ or {})


def workload(objects: list[dict]) -> dict:
    assert objects[-1]["kind"] in ("Job", "JobSet")
    return objects[-1]


def job_of(obj: dict) -> dict:
    """The batch/v1 Job a workload is, or (a JobSet) the Job its replicated job makes."""
    if obj["kind"] == "Job":
        return obj
    template = obj["spec"]["replicatedJobs"][0]["template"]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": obj["metadata"]["name"] + "-node-0", **template["metadata"]},
        "spec": template["spec"],
    }


def pod_of(objects: list[dict]) -> dict:
    return job_of(workload(objects))["spec"]["template"]["spec"]


def validate(obj: dict) -> None:
    """Strict OpenAPI validation; a JobSet's own fields against its CRD's (pruned) schema, the Job
    it makes against batch/v1's."""
    if obj["kind"] == "JobSet":
        assert obj["apiVersion"] == k8s_objects.JOBSET_API_VERSION
        jsonschema.validate(obj["spec"], JOBSET_SPEC_SCHEMA)
        kubernetes_validate.validate(job_of(obj), KUBERNETES_VERSION, strict=True)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_object_of_a_run_validates_against_the_kubernetes_schema(project, cluster, nodes):
    """ConfigMaps, the Secret and the Job (or the JobSet and the Job it makes): strict."""
    _, objects = build(project, cluster, nodes=nodes)
    assert [o["kind"] for o in objects][-2:] == ["Secret", "Job" if nodes == 1 else "JobSet"]
    for obj in objects:
        validate(obj)


def test_the_strict_checks_catch_a_misspelt_field(project, cluster):
    """Both checks are live: a misspelt field in the JobSet's spec or in its Job is an error."""
    _, objects = build(project, cluster, nodes=2)
    jobset = copy.deepcopy(workload(objects))
    jobset["spec"]["failurePolicy"]["maxRestart"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate(jobset)
    jobset = copy.deepcopy(workload(objects))
    jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["backofLimit"] = 0
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(jobset)


@pytest.mark.parametrize(("gone_after_seconds", "max_moves"), [(120.0, 2), (45.5, 0), (600, 5)])
@pytest.mark.parametrize("nodes", [1, 2])
def test_the_budget_follows_the_recovery_policy(
    project, cluster, nodes, gone_after_seconds, max_moves
):
    """tolerationSeconds for unreachable/not-ready = gone_after_seconds (rounded up); the pod
    replacements (Job backoffLimit) or whole-set restarts (JobSet maxRestarts) = --max-moves."""
    settings = Settings(**{**SETTINGS.__dict__, "gone_after_seconds": gone_after_seconds})
    _, objects = build(project, cluster, nodes=nodes, max_moves=max_moves, settings=settings)
    lost = {
        t["key"]: t
        for t in pod_of(objects)["tolerations"]
        if t["key"] in k8s_objects.NODE_LOST_TAINTS
    }
    assert set(lost) == {"node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"}
    for toleration in lost.values():
        assert toleration["effect"] == "NoExecute" and toleration["operator"] == "Exists"
        assert toleration["tolerationSeconds"] == math.ceil(gone_after_seconds)
    job = job_of(workload(objects))["spec"]
    assert job["podReplacementPolicy"] == "TerminatingOrFailed"
    assert "podFailurePolicy" not in job  # it would force podReplacementPolicy Failed
    if nodes == 1:
        assert job["backoffLimit"] == max_moves and job["completions"] == 1
    else:
        spec = workload(objects)["spec"]
        assert spec["failurePolicy"] == {"maxRestarts": max_moves, "restartStrategy": "Recreate"}
        assert job["backoffLimit"] == 0  # one node's pod failing restarts the whole set
        assert job["completionMode"] == "Indexed" and job["completions"] == nodes


def test_the_pod_runs_the_supervisor_over_the_plan_of_the_ssh_path(project, cluster):
    """One node: the pod's command ends in the supervisor over plan.json, a plan whose train
    phase is the SSH path's `dvc exp run` with the launch's overrides, in the run directory on
    the checkpoints volume; the pod never restarts in place."""
    launch_id, objects = build(project, cluster, gpus=8)
    pod = pod_of(objects)
    assert pod["restartPolicy"] == "Never"
    args = pod["containers"][0]["args"]
    assert args[:2] == ["sh", "-c"]
    assert (
        args[2].rstrip().endswith('exec python -m clipforge.launcher.host.supervisor run "$node"')
    )
    files = objects[0]["data"]
    plan = PhasePlan.from_json(files["plan-0.json"])
    train = next(p for p in plan.phases if p.name == "train")
    options = options_for(1, 8)
    assert train.argv == dvc_train_argv("python", options.overrides)
    run_dir = f"/workspace/checkpoints/clipforge-runs/runs/{launch_id}"
    assert train.cwd == f"{run_dir}/node-0/code"
    assert train.env["CLIPFORGE_RUN_RECORD"] == f"{run_dir}/run.json"
    record = json.loads(files["run.json"])
    assert record["launch_id"] == launch_id and record["runtime"] == "host"
    assert record["hosts"] == [k8s_objects.workload_name(launch_id)] and record["image"] == IMAGE


def test_several_nodes_meet_at_pod_zero_of_the_jobset(project, cluster):
    """Each node's plan is DeepSpeed's no-SSH launcher with its own rank, every one pointed at
    pod 0's host name in the JobSet's subdomain; the hostfile has one line per node."""
    launch_id, objects = build(project, cluster, nodes=2, gpus=8)
    name = k8s_objects.workload_name(launch_id)
    files = objects[0]["data"]
    for rank in (0, 1):
        argv = next(
            p.argv
            for p in PhasePlan.from_json(files[f"plan-{rank}.json"]).phases
            if p.name == "train"
        )
        assert argv[argv.index("--node_rank") + 1] == str(rank)
        assert argv[argv.index("--master_addr") + 1] == f"{name}-node-0-0.{name}"
        assert argv[argv.index("--num_gpus") + 1] == "8"
    assert files["hostfile"].count("slots=8") == 2
    spec = workload(objects)["spec"]
    assert spec["network"]["subdomain"] == name and spec["network"]["enableDNSHostnames"]
    assert spec["replicatedJobs"][0]["name"] == k8s_objects.REPLICATED_JOB
    assert json.loads(files["run.json"])["master"] == f"{name}-node-0-0.{name}:29500"


def test_pods_get_the_volumes_shm_security_and_resources_of_the_workers(project, cluster):
    """The volumes, /dev/shm, security contexts and GPU request of the stack's worker pods (the
    StatefulSet infra/ renders); no SSH keys, since nothing connects to a run's pod."""
    worker = next(
        o["spec"]["template"]["spec"]
        for o in run_program(*stack_config("example-2x8")).kubernetes_objects()
        if o["kind"] == "StatefulSet"
    )
    _, objects = build(project, cluster, gpus=8)
    pod = pod_of(objects)
    mine = {v["name"]: v for v in pod["volumes"]}
    for volume in worker["volumes"]:
        if volume["name"] == "ssh-keys":
            assert volume["name"] not in mine
        elif volume["name"] == "dshm":
            assert mine["dshm"]["emptyDir"]["medium"] == "Memory"
        else:
            assert mine[volume["name"]] == volume
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert {m["mountPath"] for m in worker["containers"][0]["volumeMounts"]} - mounts == {
        contract.SSH_KEYS_MOUNT_PATH
    }
    assert pod["securityContext"] == worker["securityContext"]
    assert pod["containers"][0]["securityContext"] == worker["containers"][0]["securityContext"]
    # the stack's outputs carry the workers' scheduling: the same resources, selector, tolerations
    assert pod["containers"][0]["resources"] == worker["containers"][0]["resources"]
    assert pod["nodeSelector"] == worker["nodeSelector"]
    for toleration in worker.get("tolerations", []):
        assert toleration in pod["tolerations"]
    worker_env = {e["name"]: e.get("value") for e in worker["containers"][0]["env"]}
    for env in pod["containers"][0]["env"]:
        assert worker_env[env["name"]] == env["value"]
    assert {"secretRef": {"name": contract.ALERTS_SECRET, "optional": True}} in pod["containers"][
        0
    ]["envFrom"]


def test_the_stack_s_scheduling_keys_reach_the_pod(project):
    """gpu_node_selector, gpu_tolerations, cpu/memory per worker and shm_size from the stack's
    outputs: the pod's node selector, tolerations, Guaranteed resources, /dev/shm."""
    raw = stack_outputs()
    raw.update(
        gpu_node_selector={"nvidia.com/gpu.present": "true"},
        gpu_tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        cpu_per_worker="16",
        memory_per_worker="128Gi",
        shm_size="32Gi",
    )
    _, objects = build(project, k8s_objects.parse_cluster(raw, "outputs"), gpus=8)
    pod = pod_of(objects)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0] == raw["gpu_tolerations"][0]
    resources = pod["containers"][0]["resources"]
    assert (
        resources["requests"]
        == resources["limits"]
        == {
            "nvidia.com/gpu": "8",
            "cpu": "16",
            "memory": "128Gi",
        }
    )
    assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "32Gi"
    for obj in objects:
        validate(obj)


def test_a_cpu_run_asks_for_no_gpu(project, cluster):
    _, objects = build(project, cluster, gpus=0)
    resources = pod_of(objects)["containers"][0].get("resources", {})
    for kind in ("requests", "limits"):
        assert not any("gpu" in name for name in resources.get(kind, {})), resources


def test_the_launch_s_secrets_are_in_its_secret_only(project, cluster):
    """The store's credentials (PASSTHROUGH_ENV values of the launching shell) go into the run's
    Secret, read by the pod with envFrom; no other object holds them, and unknown variables are
    not passed."""
    environ = {"AWS_SECRET_ACCESS_KEY": "s3cr3t-value", "HOME": "/home/me"}
    launch_id, objects = build(project, cluster, environ=environ)
    secret = next(o for o in objects if o["kind"] == "Secret")
    assert secret["stringData"] == {"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"}
    others = [o for o in objects if o is not secret]
    assert "s3cr3t-value" not in k8s_objects.to_yaml(others)
    assert {"secretRef": {"name": secret["metadata"]["name"]}} in pod_of(objects)["containers"][0][
        "envFrom"
    ]


def test_the_commit_is_shipped_in_configmap_sized_pieces(project, cluster, tmp_path):
    """The git bundle is split into immutable ConfigMaps of at most BUNDLE_CHUNK_BYTES each, all
    projected into the pod's run files, which put back together hold the commit."""
    _, objects = build(project, cluster)
    pieces = [o for o in objects if o["kind"] == "ConfigMap" and "binaryData" in o]
    assert pieces and all(o["immutable"] for o in pieces)
    data = {k: base64.b64decode(v) for o in pieces for k, v in o["binaryData"].items()}
    assert all(len(piece) <= k8s_objects.BUNDLE_CHUNK_BYTES for piece in data.values())
    bundle = tmp_path / "code.bundle"
    bundle.write_bytes(b"".join(data[key] for key in sorted(data)))
    listed = subprocess.run(
        ["git", "bundle", "list-heads", str(bundle)], capture_output=True, text=True, check=True
    )
    assert current_source(project).commit in listed.stdout
    sources = pod_of(objects)["volumes"][-1]["projected"]["sources"]
    assert [s["configMap"]["name"] for s in sources] == [
        o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"
    ]


def test_the_launcher_reads_the_outputs_of_a_released_stack():
    """After `make down` the volumes and secrets stay and the GPUs are free: a Kubernetes run may
    use them. The names are the stack's (infra/clipforge_infra/contract.py)."""
    cluster = k8s_objects.parse_cluster(stack_outputs(released=True), "outputs")
    assert {v.claim for v in cluster.volumes} == {v.claim_name for v in contract.VOLUMES}
    assert cluster.run_root == "/workspace/checkpoints/clipforge-runs"
    assert (k8s_objects.ALERTS_SECRET, k8s_objects.REGISTRY_SECRET) == (
        contract.ALERTS_SECRET,
        contract.REGISTRY_SECRET,
    )
    assert (k8s_objects.RUN_AS_UID, k8s_objects.RUN_AS_GID, k8s_objects.SHM_MOUNT_PATH) == (
        contract.RUN_AS_UID,
        contract.RUN_AS_GID,
        contract.SHM_MOUNT_PATH,
    )
    assert k8s_objects.labels("x")["app.kubernetes.io/component"] == contract.RUN_COMPONENT


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"namespace": ""}, "namespace"),
        ({"gpus_per_worker": "8"}, "gpus_per_worker"),
        ({"volumes": {"logs": {"claim": "x", "mount_path": "/l"}}}, "volumes.checkpoints"),
        ({"gpu_tolerations": "nvidia.com/gpu"}, "gpu_tolerations"),
    ],
)
def test_malformed_outputs_are_refused_naming_the_key(change, key):
    raw = {**stack_outputs(), **change}
    with pytest.raises(LauncherError, match=f"`{key}` missing or malformed"):
        k8s_objects.parse_cluster(raw, "outputs")


# -- kubectl ---------------------------------------------------------------------------------------
STUB_KUBECTL = """#!{python}
import json, os, sys
with open(os.environ["STUB_KUBECTL_LOG"], "a") as log:
    log.write(json.dumps({{"argv": sys.argv[1:], "stdin": "" if sys.stdin.isatty() else sys.stdin.read()}}) + "\\n")
if "api-resources" in sys.argv:
    print(os.environ.get("STUB_KUBECTL_RESOURCES", ""))
elif "apply" in sys.argv:
    print("job.batch/clipforge-x serverside-applied")
elif "get" in sys.argv:
    print(os.environ.get("STUB_KUBECTL_GET", ""))
elif "delete" in sys.argv:
    print("job.batch/clipforge-x deleted")
"""


@pytest.fixture
def kubectl(tmp_path, monkeypatch):
    """A `kubectl` on PATH that records each call (argv, stdin) and answers discovery with
    $STUB_KUBECTL_RESOURCES, `get` with $STUB_KUBECTL_GET."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "kubectl"
    stub.write_text(STUB_KUBECTL.format(python=sys.executable))
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "kubectl.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_KUBECTL_LOG", str(log))
    return lambda: [json.loads(line) for line in log.read_text().splitlines()]


def test_without_kubectl_the_launch_stops_naming_the_remedy(
    project, cluster, tmp_path, monkeypatch
):
    options = options_for(1, 8)
    prepared = prepare(current_source(project), options, SETTINGS)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LauncherError, match="kubectl is not on PATH; install it"):
        kube.launch(cluster, prepared, options, SETTINGS, 2, print, {})


def test_several_nodes_without_the_jobset_crd_stop_naming_the_remedy(project, cluster, kubectl):
    """Discovery finds no jobsets.jobset.x-k8s.io: one line naming JobSet's release manifest and
    --nodes 1; nothing is applied."""
    options = options_for(2, 8)
    prepared = prepare(current_source(project), options, SETTINGS)
    with pytest.raises(LauncherError) as error:
        kube.launch(cluster, prepared, options, SETTINGS, 2, print, {})
    assert "install its release manifest" in str(error.value)
    assert k8s_objects.JOBSET_RELEASES in str(error.value) and "(--nodes 1)" in str(error.value)
    assert [call["argv"][-4] for call in kubectl()] == ["api-resources"]


def test_the_run_is_applied_server_side_in_the_stack_s_context(
    project, cluster, kubectl, monkeypatch
):
    """With JobSet installed, the objects go to `kubectl apply --server-side -f -` on stdin, in
    the stack's context and namespace."""
    monkeypatch.setenv("STUB_KUBECTL_RESOURCES", "jobsets.jobset.x-k8s.io")
    options = options_for(2, 8)
    prepared = prepare(current_source(project), options, SETTINGS)
    said: list[str] = []
    launch_id = kube.launch(cluster, prepared, options, SETTINGS, 2, said.append, {})
    calls = kubectl()
    apply = calls[-1]
    assert apply["argv"][:4] == [
        "--context",
        cluster.kube_context,
        "--namespace",
        cluster.namespace,
    ]
    assert apply["argv"][4:] == [
        "apply", "--server-side", f"--field-manager={k8s_objects.FIELD_MANAGER}", "-f", "-",
    ]  # fmt: skip
    applied = list(yaml.safe_load_all(apply["stdin"]))
    assert applied[-1]["kind"] == "JobSet"
    assert applied[-1]["metadata"]["labels"][LAUNCH_LABEL] == launch_id
    assert any(f"started run {launch_id}" in line for line in said)


def test_fab_train_kubernetes_applies_a_job_from_the_stack_outputs(project, tmp_path, kubectl):
    """The real `fab train --kubernetes --gpus 0` with the stack's outputs (a released stack):
    one Job applied, named after the launch it prints."""
    outputs = tmp_path / "stack-outputs.json"
    outputs.write_text(json.dumps(stack_outputs(released=True)))
    fab = make_fab(project, tmp_path / "home", tmp_path / "remote")
    fab.env.update(
        FABRIC_CLIPFORGE_STACK_OUTPUTS=str(outputs),
        PATH=os.environ["PATH"],
        STUB_KUBECTL_LOG=os.environ["STUB_KUBECTL_LOG"],
    )
    result = fab("train", "--kubernetes", "--gpus", "0", "--data", "build", "--image", IMAGE)
    assert result.returncode == 0, result.stdout + result.stderr
    applied = list(yaml.safe_load_all(kubectl()[-1]["stdin"]))
    job = applied[-1]
    assert job["kind"] == "Job"
    launch_id = job["metadata"]["labels"][LAUNCH_LABEL]
    assert f"started run {launch_id} on the cluster" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--spare", "user@c"), "no --spare: Kubernetes replaces a lost node itself"),
        (("--runtime", "docker"), "the pod runs the image already"),
        (("-H", "user@host"), "not on -H hosts"),
    ],
)
def test_fab_train_kubernetes_refuses_what_does_not_apply_in_one_line(
    project, tmp_path, args, message
):
    fab = make_fab(project, tmp_path / "home", tmp_path / "remote")
    hosts, args = (args[1], ()) if args[0] == "-H" else (None, args)
    result = fab("train", "--kubernetes", "--gpus", "0", *args, hosts=hosts)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr


# -- a stack of runMode jobs: `fab train` without -H is a Job ----------------------------------
def jobs_stack(tmp_path: Path, project: Path):
    """`fab` in the project, with the outputs `make up` writes for a stack of runMode jobs."""
    outputs = tmp_path / "stack-outputs.json"
    outputs.write_text(json.dumps(stack_outputs("example-1x4", runMode="jobs")))
    fab = make_fab(project, tmp_path / "home", tmp_path / "remote")
    fab.env.update(
        FABRIC_CLIPFORGE_STACK_OUTPUTS=str(outputs),
        PATH=os.environ["PATH"],
        STUB_KUBECTL_LOG=os.environ.get("STUB_KUBECTL_LOG", ""),
    )
    return fab


def test_fab_train_on_a_jobs_stack_applies_a_job_without_the_flag(project, tmp_path, kubectl):
    """`fab train --gpus 0` with no -H and no --kubernetes, on a stack whose runMode is jobs:
    the run is a Job on the stack's cluster (the stack has no SSH worker to start it on)."""
    fab = jobs_stack(tmp_path, project)
    result = fab("train", "--gpus", "0", "--data", "build", "--image", IMAGE)
    assert result.returncode == 0, result.stdout + result.stderr
    job = list(yaml.safe_load_all(kubectl()[-1]["stdin"]))[-1]
    assert job["kind"] == "Job" and job["metadata"]["namespace"] == "clipforge"
    assert f"started run {job['metadata']['labels'][LAUNCH_LABEL]} on the cluster" in (
        result.stdout
    )


@pytest.mark.parametrize("task", [("logs",), ("stop",), ("status",), ("check",)])
def test_the_ssh_tasks_on_a_jobs_stack_say_in_one_line_what_to_use(project, tmp_path, task):
    """No SSH worker to ask: each says to read the run from the store (--launch) or with
    `kubectl logs -l clipforge/launch-id=...`, without a traceback."""
    result = jobs_stack(tmp_path, project)(*task)
    assert result.returncode != 0
    assert "runMode: jobs" in result.stderr and "Traceback" not in result.stderr
    assert f"logs -l {LAUNCH_LABEL}=ID" in result.stderr


def test_fab_status_of_a_run_on_a_jobs_stack_reads_the_run_store(project, tmp_path):
    """`fab status --launch ID --store DIR` without -H on a jobs stack: the run store answers
    (here: it has no such run, and says so by its name)."""
    store = tmp_path / "store"
    store.mkdir()
    result = jobs_stack(tmp_path, project)(
        "status", "--launch", "20990101-000000-deadbeef", "--store", str(store)
    )
    assert result.returncode != 0
    assert f"the run store {store} has no run 20990101-000000-deadbeef" in result.stderr


# -- `--resume`: the run submitted again once its budget is spent --------------------------------
def failed_job(name: str, condition: str = "Failed") -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "status": {"conditions": [{"type": condition, "status": "True"}], "failed": 3},
    }


@pytest.mark.parametrize(
    ("conditions", "phase"),
    [
        ([], k8s_objects.WorkloadPhase.ACTIVE),
        ([{"type": "Suspended", "status": "False"}], k8s_objects.WorkloadPhase.ACTIVE),
        ([{"type": "FailureTarget", "status": "True"}], k8s_objects.WorkloadPhase.FAILED),
        ([{"type": "Failed", "status": "True"}], k8s_objects.WorkloadPhase.FAILED),
        ([{"type": "Failed", "status": "False"}], k8s_objects.WorkloadPhase.ACTIVE),
        ([{"type": "Complete", "status": "True"}], k8s_objects.WorkloadPhase.COMPLETE),
        ([{"type": "Completed", "status": "True"}], k8s_objects.WorkloadPhase.COMPLETE),  # a JobSet
    ],
)
def test_a_workload_s_phase_is_read_from_its_conditions(conditions, phase):
    """FailureTarget counts as failed: a Job whose pod is stuck on a lost node may never get
    past it to Failed."""
    assert k8s_objects.workload_phase({"status": {"conditions": conditions}}) is phase


@pytest.fixture
def stored_launch(project, cluster, tmp_path):
    """A launch of the project on the cluster, as the train stage recorded it in a run store on
    this machine (launches/RUN.json: its run.json and its training run's id)."""
    launch_id, objects = build(project, cluster, gpus=8)
    record = json.loads(objects[0]["data"]["run.json"])
    store = tmp_path / "store"
    RunStore(str(store), "run-0123456789ab").write_launch(launch_id, record)
    return launch_id, str(store)


def test_resume_submits_the_stored_launch_again_with_a_fresh_budget(
    project, cluster, stored_launch, kubectl, monkeypatch
):
    """Its Job failed (the budget spent): the failed Job and its files are deleted, and a new
    Job of the same launch id is applied, with the stored launch's options, its run.json naming
    the same launch, and --max-moves as its backoffLimit."""
    launch_id, store = stored_launch
    name = k8s_objects.workload_name(launch_id)
    monkeypatch.setenv("STUB_KUBECTL_GET", json.dumps(failed_job(name)))
    monkeypatch.chdir(project)
    said: list[str] = []
    kube.resubmit(cluster, launch_id, store, SETTINGS, 4, said.append, {})
    calls = [call["argv"][4:] for call in kubectl()]
    assert calls[0] == ["get", "jobs.batch", name, "--ignore-not-found", "-o", "json"]
    assert calls[1] == [
        "delete", "jobs.batch,configmaps,secrets", "-l", f"{LAUNCH_LABEL}={launch_id}",
        "--wait=true",
    ]  # fmt: skip
    assert calls[2][0] == "apply"
    applied = list(yaml.safe_load_all(kubectl()[-1]["stdin"]))
    job = applied[-1]
    assert job["metadata"]["name"] == name and job["spec"]["backoffLimit"] == 4
    record = json.loads(applied[0]["data"]["run.json"])
    assert record["launch_id"] == launch_id and record["gpus_per_node"] == 8
    assert record["commit"] == current_source(project).commit
    assert any("training run run-0123456789ab" in line for line in said)


def test_resume_of_a_run_launched_in_docker_over_ssh_runs_it_on_the_image_s_python(
    project, cluster, tmp_path, kubectl, monkeypatch
):
    """A run once launched with --runtime docker on SSH hosts (gone now, its Job never made):
    submitted as a Job whose plan runs the stage on the image's Python, no docker inside."""
    launch_id, objects = build(project, cluster, gpus=8)
    record = {**json.loads(objects[0]["data"]["run.json"]), "runtime": "docker"}
    RunStore(str(tmp_path / "store"), "run-0123456789ab").write_launch(launch_id, record)
    monkeypatch.chdir(project)
    said: list[str] = []
    kube.resubmit(cluster, launch_id, str(tmp_path / "store"), SETTINGS, 2, said.append, {})
    files = list(yaml.safe_load_all(kubectl()[-1]["stdin"]))[0]["data"]
    assert json.loads(files["run.json"])["runtime"] == "host"
    phases = PhasePlan.from_json(files["plan-0.json"]).phases
    assert phases and not any("docker" in phase.argv[0] for phase in phases)
    assert any("ran with --runtime docker" in line for line in said)


def test_resume_of_several_nodes_deletes_the_failed_jobset_with_its_jobs(
    project, cluster, tmp_path, kubectl, monkeypatch
):
    """Several nodes: the JobSet is looked up (JobSet installed), deleted with the Jobs it made
    (they carry the launch's label), and a JobSet of the same launch applied."""
    launch_id, objects = build(project, cluster, nodes=2, gpus=8)
    store = tmp_path / "store"
    RunStore(str(store), "run-0123456789ab").write_launch(
        launch_id, json.loads(objects[0]["data"]["run.json"])
    )
    name = k8s_objects.workload_name(launch_id)
    jobset = {**failed_job(name), "apiVersion": k8s_objects.JOBSET_API_VERSION, "kind": "JobSet"}
    monkeypatch.setenv("STUB_KUBECTL_RESOURCES", k8s_objects.JOBSET_RESOURCE)
    monkeypatch.setenv("STUB_KUBECTL_GET", json.dumps(jobset))
    monkeypatch.chdir(project)
    kube.resubmit(cluster, launch_id, str(store), SETTINGS, 1, print, {})
    calls = [call["argv"][4:] for call in kubectl()]
    assert [c[0] for c in calls] == ["api-resources", "get", "delete", "apply"]
    assert calls[1][1:3] == [k8s_objects.JOBSET_RESOURCE, name]
    assert calls[2][1] == f"{k8s_objects.JOBSET_RESOURCE},jobs.batch,configmaps,secrets"
    applied = list(yaml.safe_load_all(kubectl()[-1]["stdin"]))[-1]
    assert applied["kind"] == "JobSet" and applied["metadata"]["name"] == name
    assert applied["spec"]["failurePolicy"]["maxRestarts"] == 1


@pytest.mark.parametrize(
    ("condition", "message"),
    [(None, "is still active"), ("Complete", "has completed")],
)
def test_resume_refuses_while_the_job_goes_on_or_once_it_completed(
    project, cluster, stored_launch, kubectl, monkeypatch, condition, message
):
    """A Job still active is Kubernetes' to resume (two would write one run); nothing is
    deleted or applied."""
    launch_id, store = stored_launch
    job = failed_job(k8s_objects.workload_name(launch_id), condition or "Failed")
    if condition is None:
        job["status"] = {"active": 1}
    monkeypatch.setenv("STUB_KUBECTL_GET", json.dumps(job))
    monkeypatch.chdir(project)
    with pytest.raises(LauncherError, match=message):
        kube.resubmit(cluster, launch_id, store, SETTINGS, 2, print, {})
    assert [call["argv"][4] for call in kubectl()] == ["get"]


def test_fab_train_resume_on_a_jobs_stack_resubmits_a_job_gone_from_the_cluster(
    project, tmp_path, stored_launch, kubectl
):
    """The real `fab train --resume ID --store DIR` on a jobs stack, the old Job gone (deleted,
    or its TTL): a Job of that launch is applied, nothing deleted."""
    launch_id, store = stored_launch
    result = jobs_stack(tmp_path, project)("train", "--resume", launch_id, "--store", store)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [call["argv"][4] for call in kubectl()] == ["get", "apply"]
    job = list(yaml.safe_load_all(kubectl()[-1]["stdin"]))[-1]
    assert job["metadata"]["labels"][LAUNCH_LABEL] == launch_id
    assert f"resubmitting run {launch_id}" in result.stdout
