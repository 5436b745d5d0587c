"""Every rendered Kubernetes object: valid against the OpenAPI schemas, and within policy."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from infra_harness import REGISTRY_AUTH, run_program, stack_config

# A current Kubernetes release, as run by managed clusters today; strict = unknown fields are errors.
KUBERNETES_VERSION = "1.33.0"
SCENARIOS = {
    "example-1x4": ("example-1x4", {}),
    "example-2x8": ("example-2x8", {}),
    "defaults": (None, {}),
    "mig-and-cluster-default-storage": (
        None,
        {"gpuResourceName": "nvidia.com/mig-3g.40gb", "storageClass": ""},
    ),
    "private-registry": ("example-2x8", {}),
    "jobs-mode": ("example-2x8", {"runMode": "jobs"}),
}
SECRETS = {"private-registry": {"registryAuth": REGISTRY_AUTH}}


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def objects(request):
    stack, overrides = SCENARIOS[request.param]
    return run_program(
        *stack_config(stack, overrides, secrets=SECRETS.get(request.param))
    ).kubernetes_objects()


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_every_object_validates_against_the_kubernetes_schema(objects):
    """kubernetes-validate (strict) accepts every object the stack would send to the API server."""
    # namespace, 3 claims, 2 Secrets, TensorBoard's Deployment and Service; the workers' 3
    assert len(objects) >= 8
    for obj in objects:
        validate(obj)


def test_schema_validation_rejects_a_misspelt_field(objects):
    """The strict validation is live: a misspelt field in a pod template is reported."""
    workload = copy.deepcopy(
        next(obj for obj in objects if obj["kind"] in ("StatefulSet", "Deployment"))
    )
    workload["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(workload)


def pod_specs(objects):
    specs = [
        obj["spec"]["template"]["spec"]
        for obj in objects
        if obj["kind"] in ("StatefulSet", "Deployment")
    ]
    assert specs, "no pod templates rendered"
    return specs


def containers(spec):
    return spec["containers"] + spec.get("initContainers", [])


def test_every_container_runs_as_non_root(objects):
    """runAsNonRoot holds for every container (set on the pod or the container) with a non-zero uid."""
    for spec in pod_specs(objects):
        pod = spec.get("securityContext", {})
        for container in containers(spec):
            own = container.get("securityContext", {})
            assert own.get("runAsNonRoot", pod.get("runAsNonRoot")) is True
            assert own.get("runAsUser", pod.get("runAsUser")) not in (None, 0)


def test_every_container_sets_cpu_and_memory_requests_and_limits(objects):
    """No container runs without requests and limits for CPU and memory."""
    for spec in pod_specs(objects):
        for container in containers(spec):
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), container["name"]


def test_no_container_is_privileged_or_can_escalate(objects):
    """privileged is never true and privilege escalation is off everywhere."""
    for spec in pod_specs(objects):
        for container in containers(spec):
            context = container.get("securityContext", {})
            assert context.get("privileged") is not True
            assert context.get("allowPrivilegeEscalation") is False
            assert "ALL" in context.get("capabilities", {}).get("drop", [])


def test_no_pod_uses_host_paths_or_host_namespaces(objects):
    """No hostPath volume, host network, host PID or host IPC."""
    for spec in pod_specs(objects):
        assert not any("hostPath" in volume for volume in spec.get("volumes", []))
        for field in ("hostNetwork", "hostPID", "hostIPC"):
            assert spec.get(field) is not True


def network_policies(objects) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == "NetworkPolicy"]


def matches(match_labels: dict, pod_labels: dict) -> bool:
    return all(pod_labels.get(key) == value for key, value in match_labels.items())


def guarding(objects, pod_labels: dict) -> list[dict]:
    """The NetworkPolicies that select a pod of these labels."""
    return [
        p
        for p in network_policies(objects)
        if matches(p["spec"]["podSelector"].get("matchLabels", {}), pod_labels)
    ]


def admitted(policy: dict) -> list[dict]:
    """The pod labels its ingress rules admit (every rule here names pods, not addresses)."""
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    return [
        peer["podSelector"]["matchLabels"]
        for rule in policy["spec"].get("ingress", [])
        for peer in rule["from"]
    ]


def test_every_pod_of_the_stack_is_reachable_only_from_its_own_kind(objects):
    """Each pod template the stack runs is selected by an ingress NetworkPolicy; TensorBoard's
    admits nothing (kubectl port-forward enters through the pod's loopback, where policies do not
    apply), the workers' only workers: no other pod of the cluster reads the run's logs or joins
    a worker's sshd or rendezvous."""
    templates = [
        obj["spec"]["template"]["metadata"]["labels"]
        for obj in objects
        if obj["kind"] in ("StatefulSet", "Deployment")
    ]
    assert templates
    for pod_labels in templates:
        (policy,) = guarding(objects, pod_labels)
        sources = admitted(policy)
        if pod_labels["app.kubernetes.io/component"] == "tensorboard":
            assert sources == []
        else:
            assert sources and all(matches(source, pod_labels) for source in sources)


def test_a_runs_pods_made_by_the_launcher_admit_only_run_pods(objects):
    """runMode jobs: the launcher's Job and JobSet pods (their labels, as the launcher writes
    them) are selected by a policy that admits run pods alone."""
    from clipforge.launcher.kubernetes_objects import labels as run_pod_labels

    pod_labels = run_pod_labels("20260101-000000-abcdef12")
    (policy,) = guarding(objects, pod_labels)
    sources = admitted(policy)
    assert sources and all(matches(source, pod_labels) for source in sources)
    worker = {**pod_labels, "app.kubernetes.io/component": "worker"}
    assert not any(matches(source, worker) for source in sources)
