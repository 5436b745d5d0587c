"""Typed, validated stack configuration.

``parse_settings`` is pure: it takes the raw string values Pulumi hands the program (arrays arrive as
JSON text) and returns frozen dataclasses, or raises ``StackConfigError`` naming the key, the problem and
the command that fixes it. Defaults live only in ``Pulumi.yaml``; a key that reaches this module
without a value means the program runs outside the Pulumi CLI, and that is an error too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from clipforge.alerts.targets import parse_targets

from .contract import PROJECT, VOLUMES
from .quantities import QuantityError, parse_bytes, parse_cpu_millicores

# Every key Pulumi.yaml declares; tests keep the two in step.
CONFIG_KEYS = (
    "kubeContext",
    "namespace",
    "released",
    "image",
    "numWorkers",
    "gpusPerWorker",
    "gpuResourceName",
    "gpuNodeSelector",
    "gpuTolerations",
    "cpuPerWorker",
    "memoryPerWorker",
    "shmSize",
    "storageClass",
    "datasetsSize",
    "checkpointsSize",
    "logsSize",
    "tensorboardCpu",
    "tensorboardMemory",
    "pricePerGpuHour",
    "priceCurrency",
    "sshAuthorizedKeys",
    "alertWebhooks",
    "registryAuth",
)
# Keys whose values must be stored encrypted (`pulumi config set --secret`), never in plain text.
SECRET_KEYS = ("sshAuthorizedKeys", "alertWebhooks", "registryAuth")

# The training image is built on CUDA, so only NVIDIA device-plugin resources can run it. Other
# vendors are listed so that the error says "unsupported" rather than "unknown".
SUPPORTED_GPU_RESOURCE_RE = re.compile(r"^nvidia\.com/(gpu|mig-[0-9]+g\.[0-9]+gb)$")
KNOWN_UNSUPPORTED_GPU_VENDORS = ("amd.com", "gpu.intel.com", "habana.ai", "aws.amazon.com")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
SSH_PUBLIC_KEY_TYPES = ("ssh-ed25519", "ssh-rsa", "ecdsa-sha2-", "sk-ssh-ed25519", "sk-ecdsa-sha2-")

_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_IMAGE_RE = re.compile(
    r"^[a-z0-9][a-z0-9._\-/:]*[a-z0-9](:[\w][\w.\-]{0,127}|@sha256:[0-9a-f]{64})$"
)
_CURRENCY_RE = re.compile(r"^[A-Z]{3}$")


class StackConfigError(ValueError):
    """A stack configuration value that cannot be used; the message names the key."""

    def __init__(self, key: str, problem: str):
        self.key = key
        super().__init__(f"config {PROJECT}:{key}: {problem}")


@dataclass(frozen=True)
class Toleration:
    key: str
    effect: str | None
    value: str | None

    def to_kubernetes(self) -> dict:
        """A core/v1 Toleration: ``Equal`` when a value is given, otherwise ``Exists``."""
        toleration = {"key": self.key, "operator": "Equal" if self.value is not None else "Exists"}
        if self.value is not None:
            toleration["value"] = self.value
        if self.effect is not None:
            toleration["effect"] = self.effect
        return toleration


@dataclass(frozen=True)
class WorkerSettings:
    num_workers: int
    gpus_per_worker: int
    gpu_resource_name: str
    node_selector: Mapping[str, str]
    tolerations: tuple[Toleration, ...]
    cpu: str
    memory: str
    shm_size: str


@dataclass(frozen=True)
class StorageSettings:
    storage_class: str  # "" = the cluster's default StorageClass
    sizes: Mapping[str, str]  # volume role -> size quantity


@dataclass(frozen=True)
class TensorBoardSettings:
    cpu: str
    memory: str


@dataclass(frozen=True)
class SecretSettings:
    """Plain secret values, held only long enough to wrap them in ``pulumi.Output.secret``."""

    ssh_authorized_keys: str = field(repr=False)
    alert_webhooks: str = field(repr=False)
    registry_auth: str = field(repr=False)  # Docker config.json text; "" = the image is public


@dataclass(frozen=True)
class StackSettings:
    kube_context: str  # "" = the kubeconfig's current-context
    namespace: str
    released: bool
    image: str
    workers: WorkerSettings
    storage: StorageSettings
    tensorboard: TensorBoardSettings
    price_per_gpu_hour: Decimal
    price_currency: str
    secrets: SecretSettings

    @property
    def total_gpus(self) -> int:
        return self.workers.num_workers * self.workers.gpus_per_worker


def parse_settings(
    raw: Mapping[str, str | None], secret_keys: frozenset[str] | set[str]
) -> StackSettings:
    """Validate the raw config (key without project prefix -> string or None)."""
    values = _Values(raw, secret_keys)
    memory = values.size("memoryPerWorker")
    shm_size = values.size("shmSize")
    # A memory-backed emptyDir is charged to the container's memory limit: /dev/shm as large as the
    # limit would leave nothing for the trainer itself.
    if parse_bytes(shm_size) >= parse_bytes(memory):
        raise StackConfigError(
            "shmSize",
            f"{shm_size} must be smaller than memoryPerWorker ({memory}): "
            "/dev/shm is memory-backed and counts against the worker's memory limit",
        )
    workers = WorkerSettings(
        num_workers=values.positive_int("numWorkers"),
        gpus_per_worker=values.positive_int("gpusPerWorker"),
        gpu_resource_name=values.gpu_resource_name("gpuResourceName"),
        node_selector=values.node_selector("gpuNodeSelector"),
        tolerations=values.tolerations("gpuTolerations"),
        cpu=values.cpu("cpuPerWorker"),
        memory=memory,
        shm_size=shm_size,
    )
    return StackSettings(
        kube_context=values.text("kubeContext"),
        namespace=values.dns_label("namespace"),
        released=values.boolean("released"),
        image=values.image("image"),
        workers=workers,
        storage=StorageSettings(
            storage_class=values.storage_class("storageClass"),
            sizes={volume.role: values.size(volume.size_key) for volume in VOLUMES},
        ),
        tensorboard=TensorBoardSettings(
            cpu=values.cpu("tensorboardCpu"), memory=values.size("tensorboardMemory")
        ),
        price_per_gpu_hour=values.price("pricePerGpuHour"),
        price_currency=values.currency("priceCurrency"),
        secrets=SecretSettings(
            ssh_authorized_keys=values.ssh_authorized_keys("sshAuthorizedKeys"),
            alert_webhooks=values.alert_webhooks("alertWebhooks"),
            registry_auth=values.registry_auth("registryAuth"),
        ),
    )


class _Values:
    """Typed accessors over the raw config; each raises StackConfigError naming its key."""

    def __init__(self, raw: Mapping[str, str | None], secret_keys: frozenset[str] | set[str]):
        unknown = sorted(set(raw) - set(CONFIG_KEYS))
        if unknown:
            raise StackConfigError(
                unknown[0], f"unknown key; Pulumi.yaml declares: {', '.join(CONFIG_KEYS)}"
            )
        self._raw = raw
        self._secret_keys = secret_keys

    def text(self, key: str) -> str:
        value = self._raw.get(key)
        if value is None:
            if key == "image":
                raise StackConfigError(
                    key,
                    "no image set: `make up` sets it from docker/image.env "
                    "(plus $REGISTRY); to pin another, `pulumi config set image REPO:TAG`",
                )
            if key in SECRET_KEYS:
                raise StackConfigError(
                    key, f"not set: `pulumi config set --secret {key} ...` (see infra/README.md)"
                )
            raise StackConfigError(
                key,
                "no value: Pulumi.yaml declares its default, so the program must be run "
                "by the Pulumi CLI (make up / make preview), not on its own",
            )
        return value

    def positive_int(self, key: str) -> int:
        text = self.text(key).strip()
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            raise StackConfigError(key, f"{text!r} is not a whole number")
        if int(text) < 1:
            raise StackConfigError(key, f"must be at least 1, got {int(text)}")
        return int(text)

    def boolean(self, key: str) -> bool:
        text = self.text(key)
        if text not in ("true", "false"):
            raise StackConfigError(key, f"{text!r} is not true or false")
        return text == "true"

    def dns_label(self, key: str) -> str:
        text = self.text(key)
        if len(text) > 63 or not _DNS_LABEL_RE.match(text):
            raise StackConfigError(
                key,
                f"{text!r} is not a Kubernetes name (lower-case letters, digits, '-'; "
                "at most 63 characters)",
            )
        return text

    def storage_class(self, key: str) -> str:
        text = self.text(key)
        if text and (len(text) > 253 or not _DNS_SUBDOMAIN_RE.match(text)):
            raise StackConfigError(key, f"{text!r} is not a StorageClass name")
        return text

    def image(self, key: str) -> str:
        text = self.text(key)
        if not text:
            raise StackConfigError(key, "empty; `make up` sets it from docker/image.env")
        if not _IMAGE_RE.match(text) or text.endswith(":latest"):
            raise StackConfigError(
                key,
                f"{text!r} is not a pinned image reference: use REPOSITORY:TAG "
                "(not :latest) or REPOSITORY@sha256:DIGEST",
            )
        return text

    def size(self, key: str) -> str:
        text = self.text(key)
        try:
            parse_bytes(text)
        except QuantityError as error:
            raise StackConfigError(key, str(error)) from None
        return text.strip()

    def cpu(self, key: str) -> str:
        text = self.text(key)
        try:
            parse_cpu_millicores(text)
        except QuantityError as error:
            raise StackConfigError(key, str(error)) from None
        return text.strip()

    def price(self, key: str) -> Decimal:
        text = self.text(key)
        try:
            price = Decimal(text)
        except InvalidOperation:
            raise StackConfigError(
                key, f"{text!r} is not a number (price per GPU-hour, e.g. 2.50)"
            ) from None
        if not price.is_finite() or price < 0:
            raise StackConfigError(key, f"{text!r} must be a number >= 0")
        return price

    def currency(self, key: str) -> str:
        text = self.text(key)
        if not _CURRENCY_RE.match(text):
            raise StackConfigError(
                key, f"{text!r} is not a three-letter currency code such as USD or CNY"
            )
        return text

    def gpu_resource_name(self, key: str) -> str:
        text = self.text(key)
        if SUPPORTED_GPU_RESOURCE_RE.match(text):
            return text
        vendor = text.split("/", 1)[0]
        if vendor in KNOWN_UNSUPPORTED_GPU_VENDORS:
            raise StackConfigError(
                key,
                f"{text!r}: vendor {vendor} is not supported, the training image is "
                "built for CUDA; use nvidia.com/gpu (or nvidia.com/mig-<profile>)",
            )
        raise StackConfigError(
            key,
            f"{text!r}: unknown GPU vendor or resource; use nvidia.com/gpu "
            "(or nvidia.com/mig-<profile>)",
        )

    def string_list(self, key: str) -> list[str]:
        text = self.text(key)
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            items = None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise StackConfigError(key, f"{text!r} is not a list of strings")
        return items

    def node_selector(self, key: str) -> dict[str, str]:
        selector: dict[str, str] = {}
        for item in self.string_list(key):
            label, sep, value = item.partition("=")
            if (
                not sep
                or not _label_key_ok(label)
                or len(value) > 63
                or not _LABEL_VALUE_RE.match(value)
            ):
                raise StackConfigError(
                    key, f"{item!r} is not LABEL=VALUE (e.g. nvidia.com/gpu.present=true)"
                )
            selector[label] = value
        return selector

    def tolerations(self, key: str) -> tuple[Toleration, ...]:
        tolerations = []
        for item in self.string_list(key):
            taint, _, effect = item.partition(":")
            label, sep, value = taint.partition("=")
            if not _label_key_ok(label) or (sep and not _LABEL_VALUE_RE.match(value)):
                raise StackConfigError(
                    key, f"{item!r} is not KEY[=VALUE][:EFFECT] (e.g. nvidia.com/gpu:NoSchedule)"
                )
            if effect and effect not in TAINT_EFFECTS:
                raise StackConfigError(
                    key, f"{item!r}: effect must be one of {', '.join(TAINT_EFFECTS)}"
                )
            tolerations.append(
                Toleration(key=label, value=value if sep else None, effect=effect or None)
            )
        return tuple(tolerations)

    def _secret_text(self, key: str) -> str:
        text = self.text(key)
        if text and key not in self._secret_keys:
            # The value is already in the stack file in clear; say so without repeating it.
            raise StackConfigError(
                key,
                f"stored in plain text; remove it (`pulumi config rm {key}`) and set it "
                f"encrypted with `pulumi config set --secret {key} ...`",
            )
        return text

    def ssh_authorized_keys(self, key: str) -> str:
        text = self._secret_text(key)
        lines = [
            line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
        ]
        if any("PRIVATE KEY" in line for line in lines):
            raise StackConfigError(
                key, "holds a private key; set the PUBLIC key (the .pub file) instead"
            )
        if not lines:
            raise StackConfigError(
                key,
                "empty; set your public key: "
                f"`pulumi config set --secret {key} < ~/.ssh/id_ed25519.pub`",
            )
        for number, line in enumerate(lines, start=1):
            if not line.startswith(SSH_PUBLIC_KEY_TYPES) or len(line.split()) < 2:
                raise StackConfigError(
                    key, f"line {number} is not an OpenSSH public key (ssh-ed25519 AAAA... comment)"
                )
        return "\n".join(lines) + "\n"

    def alert_webhooks(self, key: str) -> str:
        text = self._secret_text(key)
        entries = text.split(",")
        try:
            parse_targets(entries, source=None)  # the grammar the workers' alerts read it with
        except ValueError as error:
            raise StackConfigError(key, str(error)) from None
        return ",".join(entry.strip() for entry in entries if entry.strip())

    def registry_auth(self, key: str) -> str:
        text = self._secret_text(key).strip()
        if not text:
            return ""
        try:
            document = json.loads(text)
        except json.JSONDecodeError:
            document = None
        auths = document.get("auths") if isinstance(document, dict) else None
        if not isinstance(auths, dict) or not any(
            isinstance(entry, dict) and entry.get("auth") for entry in auths.values()
        ):
            # A credential helper (credsStore) keeps the credentials out of config.json.
            raise StackConfigError(
                key,
                'is not a Docker config.json holding credentials ("auths" with an '
                '"auth" entry); write one with `kubectl create secret docker-registry x '
                "--docker-server=... --docker-username=... --docker-password=... --dry-run=client "
                "-o jsonpath='{.data.\\.dockerconfigjson}' | base64 -d`",
            )
        return text


def _label_key_ok(label: str) -> bool:
    prefix, sep, name = label.rpartition("/")
    if sep and (len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_LABEL_NAME_RE.match(name))
