"""The Pulumi program's resource graph, run under Pulumi's mocks with the example stacks' config."""

from __future__ import annotations

import json
import typing
from decimal import Decimal

import pytest
from infra_harness import REGISTRY_AUTH, is_secret, run_program, stack_config

from clipforge_infra.contract import (
    ALERT_WEBHOOKS_ENV,
    CHECKPOINTS_MOUNT_PATH,
    DATASETS_MOUNT_PATH,
    LOGS_MOUNT_PATH,
    RUN_MODES,
    SSH_KEYS_MOUNT_PATH,
    SSH_PORT,
)
from clipforge_infra.settings import StackConfig
from clipforge_infra.stack_outputs import OUTPUT_KEYS

EXAMPLE_STACKS = ("example-1x4", "example-2x8")
STATEFULSET = "kubernetes:apps/v1:StatefulSet"
DEPLOYMENT = "kubernetes:apps/v1:Deployment"
NAMESPACE = "kubernetes:core/v1:Namespace"
PVC = "kubernetes:core/v1:PersistentVolumeClaim"
SECRET = "kubernetes:core/v1:Secret"


@pytest.fixture(scope="module", params=EXAMPLE_STACKS)
def example(request):
    """(stack name, the config the program sees, the program run) for each example stack."""
    config, secret_keys = stack_config(request.param)
    return request.param, config, run_program(config, secret_keys)


def worker_container(run):
    spec = run.one(STATEFULSET).inputs["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def test_gpu_limits_equal_configured_gpus_per_worker(example):
    """Each worker requests and is limited to exactly gpusPerWorker GPUs of the configured resource."""
    _, values, run = example
    _, container = worker_container(run)
    gpu = values["gpuResourceName"]
    assert container["resources"]["limits"][gpu] == values["gpusPerWorker"]
    assert container["resources"]["requests"][gpu] == values["gpusPerWorker"]


def test_replicas_equal_configured_number_of_workers(example):
    """The StatefulSet runs numWorkers pods."""
    _, values, run = example
    assert run.one(STATEFULSET).inputs["spec"]["replicas"] == int(values["numWorkers"])


def test_node_selector_and_tolerations_come_from_config(example):
    """gpuNodeSelector becomes the pod's nodeSelector, gpuTolerations its tolerations."""
    _, values, run = example
    spec, _ = worker_container(run)
    expected_selector = dict(item.split("=", 1) for item in json.loads(values["gpuNodeSelector"]))
    assert spec["nodeSelector"] == expected_selector
    tolerated = {(t["key"], t.get("value"), t.get("effect")) for t in spec["tolerations"]}
    configured = json.loads(values["gpuTolerations"])
    assert len(spec["tolerations"]) == len(configured)
    for item in configured:
        taint, _, effect = item.partition(":")
        key, _, value = taint.partition("=")
        assert (key, value if value else None, effect) in tolerated


def test_dev_shm_is_memory_backed_and_sized_from_config(example):
    """/dev/shm is an emptyDir with medium Memory and sizeLimit = shmSize."""
    _, values, run = example
    spec, container = worker_container(run)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": values["shmSize"]}


def test_workers_are_spread_one_per_node(example):
    """Required pod anti-affinity on the hostname keeps two workers off the same node."""
    _, _, run = example
    spec, _ = worker_container(run)
    pod_labels = run.one(STATEFULSET).inputs["spec"]["template"]["metadata"]["labels"]
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= pod_labels.items()


def test_storage_is_mounted_at_the_fixed_paths(example):
    """Datasets, checkpoints and logs claims are mounted where the train stage expects them."""
    _, _, run = example
    spec, container = worker_container(run)
    claim_of_volume = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in spec["volumes"]
        if "persistentVolumeClaim" in v
    }
    mounted = {m["mountPath"]: claim_of_volume.get(m["name"]) for m in container["volumeMounts"]}
    claims = {pvc.inputs["metadata"]["name"] for pvc in run.of_type(PVC)}
    for path in (DATASETS_MOUNT_PATH, CHECKPOINTS_MOUNT_PATH, LOGS_MOUNT_PATH):
        assert mounted[path] in claims


def test_workers_run_the_pinned_image_with_sshd_and_keys(example):
    """The container runs the configured image, asks the entrypoint for sshd, mounts the key Secret."""
    _, _, run = example
    spec, container = worker_container(run)
    assert container["image"] == stack_config()[0]["image"]
    env = {item["name"]: item for item in container["env"]}
    assert env["CLIPFORGE_SSHD"]["value"] == "1"
    assert container["readinessProbe"]["tcpSocket"]["port"] == SSH_PORT
    ssh_mount = next(m for m in container["volumeMounts"] if m["mountPath"] == SSH_KEYS_MOUNT_PATH)
    ssh_volume = next(v for v in spec["volumes"] if v["name"] == ssh_mount["name"])
    ssh_secret_names = {s.inputs["metadata"]["name"] for s in run.of_type(SECRET)}
    assert ssh_volume["secret"]["secretName"] in ssh_secret_names


def test_alert_webhooks_reach_workers_from_a_secret(example):
    """CLIPFORGE_ALERT_WEBHOOKS is read from a Secret key, never written as a literal value."""
    _, _, run = example
    _, container = worker_container(run)
    env = next(item for item in container["env"] if item["name"] == ALERT_WEBHOOKS_ENV)
    assert "value" not in env
    ref = env["valueFrom"]["secretKeyRef"]
    secret = next(s for s in run.of_type(SECRET) if s.inputs["metadata"]["name"] == ref["name"])
    assert ref["key"] in secret.inputs["stringData"]["value"]


def test_headless_service_and_disruption_budget_cover_the_workers(example):
    """A headless Service named by the StatefulSet and a PDB select the worker pods."""
    _, _, run = example
    statefulset = run.one(STATEFULSET).inputs
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    services = {
        s.inputs["metadata"]["name"]: s.inputs for s in run.of_type("kubernetes:core/v1:Service")
    }
    headless = services[statefulset["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    pdb = run.one("kubernetes:policy/v1:PodDisruptionBudget").inputs
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_namespace_and_claims_are_protected(example):
    """The namespace and every claim carry protect=True, so `pulumi destroy` cannot delete them."""
    _, _, run = example
    retained = run.of_type(NAMESPACE) + run.of_type(PVC)
    assert len(run.of_type(PVC)) == 3
    assert all(resource.protect for resource in retained)


def test_claims_are_read_write_many(example):
    """Every claim can be mounted by all workers at once."""
    _, _, run = example
    assert all(pvc.inputs["spec"]["accessModes"] == ["ReadWriteMany"] for pvc in run.of_type(PVC))


def test_secret_data_is_marked_secret(example):
    """Both Kubernetes Secrets receive their data as Pulumi secrets (encrypted in the state)."""
    _, _, run = example
    secrets = run.of_type(SECRET)
    assert len(secrets) == 2
    assert all(is_secret(secret.inputs["stringData"]) for secret in secrets)


def test_kubernetes_objects_are_children_of_components(example):
    """Every Kubernetes object is created under a ComponentResource, never at the stack root."""
    _, _, run = example
    components = {r.urn for r in run.resources if r.type.startswith("clipforge:infra:")}
    objects = [r for r in run.resources if r.type.startswith("kubernetes:")]
    assert objects and all(r.parent in components for r in objects)


def test_outputs_describe_workers_volumes_and_cost(example):
    """All launcher-facing outputs are present, with one host per worker and the hourly price."""
    _, values, run = example
    outputs = run.outputs
    assert set(OUTPUT_KEYS) <= set(outputs)
    assert len(outputs["workers"]) == int(values["numWorkers"])
    assert all(
        w["host"].endswith(f".{values['namespace']}.svc.cluster.local") for w in outputs["workers"]
    )
    assert {v["mount_path"] for v in outputs["volumes"].values()} == {
        DATASETS_MOUNT_PATH,
        CHECKPOINTS_MOUNT_PATH,
        LOGS_MOUNT_PATH,
    }
    gpus = int(values["numWorkers"]) * int(values["gpusPerWorker"])
    assert Decimal(outputs["cost"]["per_hour"]) == Decimal(values["pricePerGpuHour"]) * gpus
    assert outputs["tensorboard"]["service"] in {
        s.inputs["metadata"]["name"] for s in run.of_type("kubernetes:core/v1:Service")
    }


def test_released_stack_keeps_storage_and_drops_compute():
    """released=true (the path `make down` takes) removes workers and TensorBoard but keeps the
    protected namespace and claims in the stack, so nothing deletes them."""
    config, secret_keys = stack_config("example-2x8", {"released": True})
    run = run_program(config, secret_keys)
    assert run.of_type(STATEFULSET) == [] and run.of_type(DEPLOYMENT) == []
    retained = run.of_type(NAMESPACE) + run.of_type(PVC)
    assert len(retained) == 4 and all(resource.protect for resource in retained)
    assert run.outputs["workers"] == [] and run.outputs["cost"]["gpus"] == 0


@pytest.mark.parametrize("stack", EXAMPLE_STACKS)
def test_a_jobs_stack_has_no_workers_and_its_outputs_say_so(stack):
    """runMode jobs: no StatefulSet, headless Service or PodDisruptionBudget of workers (a run is
    a Job of its own); the volumes, Secrets and TensorBoard stay; the outputs say `jobs`, list no
    worker and no SSH entry pod, and the stack holds no GPU while no run goes."""
    config, secret_keys = stack_config(stack, {"runMode": "jobs"})
    run = run_program(config, secret_keys)
    assert run.of_type(STATEFULSET) == []
    assert run.of_type("kubernetes:policy/v1:PodDisruptionBudget") == []
    services = [s.inputs["metadata"]["name"] for s in run.of_type("kubernetes:core/v1:Service")]
    assert services == [run.outputs["tensorboard"]["service"]]
    assert run.one(DEPLOYMENT)
    assert len(run.of_type(PVC)) == 3 and run.of_type(SECRET)
    outputs = run.outputs
    assert set(OUTPUT_KEYS) <= set(outputs)
    assert outputs["run_mode"] == "jobs" and outputs["workers"] == []
    assert outputs["num_workers"] == 0 and outputs["ssh"]["entry_pod"] is None
    assert outputs["cost"]["gpus"] == 0
    # what a Job's pods are given, as for the workers
    assert outputs["gpus_per_worker"] == int(config["gpusPerWorker"])


def test_the_workers_mode_is_the_default_and_keeps_the_workers():
    """Pulumi.yaml's default runMode is workers: the StatefulSet and the outputs as before."""
    config, secret_keys = stack_config("example-2x8")
    assert config["runMode"] == "workers"
    run = run_program(config, secret_keys)
    assert run.one(STATEFULSET) and run.outputs["run_mode"] == "workers"
    assert len(run.outputs["workers"]) == int(config["numWorkers"])


def test_the_run_modes_are_the_contract_s():
    """StackConfig's choice of runMode is contract.RUN_MODES, which the outputs carry."""
    assert typing.get_args(typing.get_type_hints(StackConfig)["run_mode"]) == RUN_MODES


def test_default_config_gives_one_worker_with_one_gpu():
    """With only the required keys set, Pulumi.yaml's defaults give a valid 1-worker stack."""
    config, secret_keys = stack_config()
    run = run_program(config, secret_keys)
    assert run.one(STATEFULSET).inputs["spec"]["replicas"] == int(config["numWorkers"])
    assert run.one(NAMESPACE).inputs["metadata"]["name"] == config["namespace"]


def test_private_registry_credentials_become_a_pull_secret_for_every_pod():
    """registryAuth yields a secret dockerconfigjson Secret that workers and TensorBoard pull with."""
    run = run_program(*stack_config("example-1x4", secrets={"registryAuth": REGISTRY_AUTH}))
    (pull,) = [
        s for s in run.of_type(SECRET) if s.inputs["type"] == "kubernetes.io/dockerconfigjson"
    ]
    assert is_secret(pull.inputs["stringData"])
    for obj in (run.one(STATEFULSET), run.one(DEPLOYMENT)):
        pulls = obj.inputs["spec"]["template"]["spec"]["imagePullSecrets"]
        assert pulls == [{"name": pull.inputs["metadata"]["name"]}]


def test_public_image_needs_no_pull_secret(example):
    """Without registryAuth no pull Secret exists and no pod references one."""
    _, _, run = example
    assert not [
        s for s in run.of_type(SECRET) if s.inputs["type"] == "kubernetes.io/dockerconfigjson"
    ]
    assert all("imagePullSecrets" not in spec for spec in run.pod_specs())
