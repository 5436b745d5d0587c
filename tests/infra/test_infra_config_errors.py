"""Bad stack config stops the program before any resource exists, with a message naming the key."""

from __future__ import annotations

import pulumi
import pytest
from infra_harness import INFRA_DIR, WEBHOOKS, program_values, run_program, stack_config

from clipforge.errors import UserError
from clipforge_infra.settings import StackConfigError, parse_settings

KUBERNETES_TYPES = "kubernetes:"

BAD_CONFIG = {
    "zero GPUs per worker": ({"gpusPerWorker": 0}, "gpusPerWorker", "got 0; must be >= 1"),
    "negative number of workers": ({"numWorkers": -2}, "numWorkers", "must be >= 1"),
    "negative memory": ({"memoryPerWorker": "-64Gi"}, "memoryPerWorker", "not a size"),
    "malformed shm size": ({"shmSize": "lots"}, "shmSize", "not a size"),
    "zero dataset volume": ({"datasetsSize": "0Gi"}, "datasetsSize", "not a positive size"),
    "malformed CPU": ({"cpuPerWorker": "8 cores"}, "cpuPerWorker", "not a CPU amount"),
    "shm as large as memory": (
        {"shmSize": "64Gi", "memoryPerWorker": "64Gi"},
        "shmSize",
        "smaller than",
    ),
    "unknown GPU vendor": (
        {"gpuResourceName": "acme.io/tpu"},
        "gpuResourceName",
        "unknown GPU vendor",
    ),
    "non-CUDA GPU vendor": ({"gpuResourceName": "amd.com/gpu"}, "gpuResourceName", "not supported"),
    "missing image": ({"image": None}, "image", "docker/image.env"),
    "unpinned image": ({"image": "clipforge:latest"}, "image", "pinned"),
    "bad toleration effect": (
        {"gpuTolerations": ["nvidia.com/gpu:Sometimes"]},
        "gpuTolerations",
        "effect",
    ),
    "bad node selector": (
        {"gpuNodeSelector": ["no-equals-sign"]},
        "gpuNodeSelector",
        "LABEL=VALUE",
    ),
    "negative price": ({"pricePerGpuHour": "-1"}, "pricePerGpuHour", ">= 0"),
    "unknown run mode": ({"runMode": "pods"}, "runMode", "allowed: workers, jobs"),
    "bad namespace": ({"namespace": "Clip_Forge"}, "namespace", "not a Kubernetes name"),
    "SSH key in plain text": (
        {"sshAuthorizedKeys": "ssh-ed25519 AAAA x"},
        "sshAuthorizedKeys",
        "plain text",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIG))
def test_bad_config_fails_naming_the_key(case):
    """Each bad value raises a RunError whose message names the config key and the problem."""
    overrides, key, problem = BAD_CONFIG[case]
    config, secret_keys = stack_config("example-1x4", overrides)
    with pytest.raises(pulumi.RunError) as raised:
        run_program(config, secret_keys)
    message = str(raised.value)
    assert f"clipforge-infra:{key}:" in message
    assert problem in message


def test_a_value_of_another_type_than_declared_is_refused_naming_the_key():
    """A count that is not a number is refused with the key: the Pulumi CLI refuses it against
    Pulumi.yaml's `type: integer`, and outside the CLI Pulumi's typed getter does."""
    config, secret_keys = stack_config("example-1x4", {"numWorkers": "two"})
    with pytest.raises(pulumi.RunError, match="clipforge-infra:numWorkers' value 'two'"):
        run_program(config, secret_keys)


def test_a_bad_value_is_a_user_error_as_the_readme_quotes_it():
    """StackConfigError is a UserError, and its one line is the example infra/README.md gives."""
    config, secret_keys = stack_config("example-1x4", {"gpusPerWorker": 0})
    with pytest.raises(StackConfigError) as raised:
        parse_settings(program_values(config, secret_keys), secret_keys)
    assert isinstance(raised.value, UserError)
    assert f"`{raised.value}`" in (INFRA_DIR / "README.md").read_text(encoding="utf-8")


def test_bad_config_creates_no_kubernetes_resource():
    """Validation runs before the first resource: a bad stack leaves the cluster untouched."""
    config, secret_keys = stack_config("example-1x4", {"gpusPerWorker": 0})
    with pytest.raises(pulumi.RunError):
        run_program(config, secret_keys)
    # A fresh run with valid config shows the harness does record Kubernetes resources.
    assert any(
        r.type.startswith(KUBERNETES_TYPES)
        for r in run_program(*stack_config("example-1x4")).resources
    )


def test_malformed_webhook_error_does_not_echo_the_secret():
    """A malformed webhook list is reported by entry number, without printing the secret value."""
    secret = "not-a-url-but-secret-token-123"
    config, secret_keys = stack_config(
        "example-1x4", secrets={"alertWebhooks": f"{WEBHOOKS},{secret}"}
    )
    with pytest.raises(pulumi.RunError) as raised:
        run_program(config, secret_keys)
    assert "clipforge-infra:alertWebhooks: entry 3" in str(raised.value)
    assert secret not in str(raised.value)


def test_private_key_in_place_of_public_key_is_refused():
    """Pasting a private key into sshAuthorizedKeys is caught and explained."""
    private = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEA\n-----END OPENSSH PRIVATE KEY-----"
    config, secret_keys = stack_config("example-1x4", secrets={"sshAuthorizedKeys": private})
    with pytest.raises(
        pulumi.RunError, match="clipforge-infra:sshAuthorizedKeys: holds a private key"
    ):
        run_program(config, secret_keys)


def test_registry_auth_without_credentials_is_refused_without_echo():
    """A config.json whose credentials live in a helper (no "auth") is refused, without printing it."""
    helper_only = '{"auths": {"registry.example": {}}, "credsStore": "desktop-secret-9f3"}'
    config, secret_keys = stack_config("example-1x4", secrets={"registryAuth": helper_only})
    with pytest.raises(pulumi.RunError) as raised:
        run_program(config, secret_keys)
    assert "clipforge-infra:registryAuth:" in str(raised.value)
    assert "desktop-secret-9f3" not in str(raised.value)
