"""Typed, validated stack configuration: every key Pulumi.yaml declares, declared once here.

`StackConfig` has one field per Pulumi.yaml key (the field is the key in snake_case), declared
with the `knob` the params sections use (clipforge.fields): its type (Pulumi.yaml's `type`), its
doc (Pulumi.yaml's `description`, word for word), its check, and whether it is a secret.
`declaration_problems` says where Pulumi.yaml and these declarations disagree (the tests hold it
to none), and `python -m clipforge_infra.settings --write` (from infra/) writes Pulumi.yaml's
descriptions from the docs. Defaults live only in Pulumi.yaml: every field is REQUIRED, because
the Pulumi CLI hands the program a value for every key that has a default, and a key without a
value means the program runs outside the CLI (or the key has no default by decision: the image,
the SSH key).

``parse_settings`` is pure: it takes the values as Pulumi's typed Config returns them (`get_int`,
`get_bool`, `get_object`, `get`: int, bool, list, str; None when unset) and returns frozen
dataclasses, or raises ``StackConfigError`` naming the key, the problem and the command that
fixes it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Literal

import yaml

from clipforge.alerts.targets import WebhookError, parse_targets
from clipforge.fields import REQUIRED, ConfigError, Section, knob
from clipforge.util import short_repr

from .contract import PROJECT, RUN_MODE_WORKERS, VOLUMES
from .quantities import QuantityError, parse_bytes, parse_cpu_millicores

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


class StackConfigError(ConfigError):
    """A stack configuration value that cannot be used; the message names the key
    (`config clipforge-infra:KEY: ...`) and what to do. A UserError: the program reports it as a
    pulumi.RunError, one line without a traceback."""


def full_key(key: str) -> str:
    """A Pulumi.yaml key as messages name it: `config clipforge-infra:numWorkers`."""
    return f"config {PROJECT}:{key}"


def _problem(key: str, problem: str) -> StackConfigError:
    return StackConfigError(f"{key}: {problem}")


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


# The checks of the keys whose type and range do not say enough: check(key, value) -> value, the
# value as the stack uses it (quantities stripped), raising StackConfigError naming `key`.


def _dns_label(key: str, text: str) -> str:
    if len(text) > 63 or not _DNS_LABEL_RE.match(text):
        raise _problem(
            key,
            f"{short_repr(text)} is not a Kubernetes name (lower-case letters, digits, '-'; "
            "at most 63 characters)",
        )
    return text


def _storage_class(key: str, text: str) -> str:
    if text and (len(text) > 253 or not _DNS_SUBDOMAIN_RE.match(text)):
        raise _problem(key, f"{short_repr(text)} is not a StorageClass name")
    return text


def _image(key: str, text: str) -> str:
    if not text:
        raise _problem(key, "empty; `make up` sets it from docker/image.env")
    if not _IMAGE_RE.match(text) or text.endswith(":latest"):
        raise _problem(
            key,
            f"{short_repr(text)} is not a pinned image reference: use REPOSITORY:TAG "
            "(not :latest) or REPOSITORY@sha256:DIGEST",
        )
    return text


def _size(key: str, text: str) -> str:
    try:
        parse_bytes(text)
    except QuantityError as error:
        raise _problem(key, str(error)) from None
    return text.strip()


def _cpu(key: str, text: str) -> str:
    try:
        parse_cpu_millicores(text)
    except QuantityError as error:
        raise _problem(key, str(error)) from None
    return text.strip()


def _price(key: str, text: str) -> str:
    try:
        price = Decimal(text)
    except InvalidOperation:
        raise _problem(
            key, f"{short_repr(text)} is not a number (price per GPU-hour, e.g. 2.50)"
        ) from None
    if not price.is_finite() or price < 0:
        raise _problem(key, f"{short_repr(text)} must be a number >= 0")
    return text


def _currency(key: str, text: str) -> str:
    if not _CURRENCY_RE.match(text):
        raise _problem(
            key, f"{short_repr(text)} is not a three-letter currency code such as USD or CNY"
        )
    return text


def _gpu_resource_name(key: str, text: str) -> str:
    if SUPPORTED_GPU_RESOURCE_RE.match(text):
        return text
    vendor = text.split("/", 1)[0]
    if vendor in KNOWN_UNSUPPORTED_GPU_VENDORS:
        raise _problem(
            key,
            f"{short_repr(text)}: vendor {vendor} is not supported, the training image is "
            "built for CUDA; use nvidia.com/gpu (or nvidia.com/mig-<profile>)",
        )
    raise _problem(
        key,
        f"{short_repr(text)}: unknown GPU vendor or resource; use nvidia.com/gpu "
        "(or nvidia.com/mig-<profile>)",
    )


def node_selector(key: str, items: list[str]) -> dict[str, str]:
    """`LABEL=VALUE` items as a nodeSelector."""
    selector: dict[str, str] = {}
    for item in items:
        label, sep, value = item.partition("=")
        if (
            not sep
            or not _label_key_ok(label)
            or len(value) > 63
            or not _LABEL_VALUE_RE.match(value)
        ):
            raise _problem(
                key, f"{short_repr(item)} is not LABEL=VALUE (e.g. nvidia.com/gpu.present=true)"
            )
        selector[label] = value
    return selector


def tolerations(key: str, items: list[str]) -> tuple[Toleration, ...]:
    """`KEY[=VALUE][:EFFECT]` items as tolerations."""
    found = []
    for item in items:
        taint, _, effect = item.partition(":")
        label, sep, value = taint.partition("=")
        if not _label_key_ok(label) or (sep and not _LABEL_VALUE_RE.match(value)):
            raise _problem(
                key,
                f"{short_repr(item)} is not KEY[=VALUE][:EFFECT] (e.g. nvidia.com/gpu:NoSchedule)",
            )
        if effect and effect not in TAINT_EFFECTS:
            raise _problem(
                key, f"{short_repr(item)}: effect must be one of {', '.join(TAINT_EFFECTS)}"
            )
        found.append(Toleration(key=label, value=value if sep else None, effect=effect or None))
    return tuple(found)


def _checked(parse: Any) -> Any:
    """A check from a parser: the value passes when it parses; the settings parse it again."""

    def check(key: str, value: Any) -> Any:
        parse(key, value)
        return value

    return check


def _ssh_authorized_keys(key: str, text: str) -> str:
    lines = [
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    ]
    if any("PRIVATE KEY" in line for line in lines):
        raise _problem(key, "holds a private key; set the PUBLIC key (the .pub file) instead")
    if not lines:
        raise _problem(
            key,
            "empty; set your public key: "
            "`pulumi config set --secret sshAuthorizedKeys < ~/.ssh/id_ed25519.pub`",
        )
    for number, line in enumerate(lines, start=1):
        if not line.startswith(SSH_PUBLIC_KEY_TYPES) or len(line.split()) < 2:
            raise _problem(
                key, f"line {number} is not an OpenSSH public key (ssh-ed25519 AAAA... comment)"
            )
    return "\n".join(lines) + "\n"


def _alert_webhooks(key: str, text: str) -> str:
    entries = text.split(",")
    try:
        parse_targets(entries, source=None)  # the grammar the workers' alerts read it with
    except WebhookError as error:
        raise _problem(key, str(error)) from None
    return ",".join(entry.strip() for entry in entries if entry.strip())


def _registry_auth(key: str, text: str) -> str:
    text = text.strip()
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
        raise _problem(
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


def pulumi_key(name: str) -> str:
    """A field's Pulumi.yaml key: its name in camelCase (num_workers -> numWorkers)."""
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)


@dataclass(frozen=True, kw_only=True)
class StackConfig(Section):
    """Every key of Pulumi.yaml's `config`, in its order; each doc is the key's description there.
    Checked field by field on construction (type, range, check), then across keys."""

    SECTION = PROJECT
    ERROR = StackConfigError

    @classmethod
    def key_of(cls, name: str) -> str:
        return full_key(pulumi_key(name))

    kube_context: str = knob(
        REQUIRED,
        "kubeconfig context of the target cluster; empty = the kubeconfig's current-context",
    )
    namespace: str = knob(
        REQUIRED,
        "namespace holding everything; retained (with the volumes) across `make down`",
        check=_dns_label,
    )
    released: bool = knob(
        REQUIRED,
        "set by `make down` (true) and `make up` (false); true deletes the GPU workers and "
        "TensorBoard and keeps storage",
    )
    run_mode: Literal["workers", "jobs"] = knob(
        REQUIRED,
        "workers: idle SSH workers (a StatefulSet) that `fab train` starts runs on; jobs: no "
        "workers, each `fab train` is a Kubernetes Job (JobSet for several nodes) that "
        "Kubernetes moves off a lost node (docs/launcher.md, On the Kubernetes stack)",
    )
    image: str = knob(
        REQUIRED,
        "training image REPOSITORY:TAG; `make up` passes [$REGISTRY/]IMAGE_REPOSITORY:IMAGE_TAG "
        "from docker/image.env unless the stack sets one",
        check=_image,
    )
    num_workers: int = knob(
        REQUIRED,
        "number of GPU workers (one per GPU node); more than one gives a multi-node DeepSpeed run",
        ge=1,
    )
    gpus_per_worker: int = knob(
        REQUIRED,
        "GPUs each worker requests (limits = requests); the DeepSpeed hostfile's slots",
        ge=1,
    )
    gpu_resource_name: str = knob(
        REQUIRED,
        "extended resource the device plugin advertises; NVIDIA only (nvidia.com/gpu or "
        "nvidia.com/mig-<profile>), the image is CUDA",
        check=_gpu_resource_name,
    )
    gpu_node_selector: list[str] = knob(
        REQUIRED,
        "LABEL=VALUE node labels a worker's node must carry, e.g. nvidia.com/gpu.present=true",
        check=_checked(node_selector),
    )
    gpu_tolerations: list[str] = knob(
        REQUIRED,
        "taints of GPU nodes the workers tolerate, KEY[=VALUE][:EFFECT]",
        check=_checked(tolerations),
    )
    cpu_per_worker: str = knob(
        REQUIRED, "CPU per worker (requests = limits), cores or millicores", check=_cpu
    )
    memory_per_worker: str = knob(
        REQUIRED, "memory per worker (requests = limits), /dev/shm included", check=_size
    )
    shm_size: str = knob(
        REQUIRED,
        "size of the memory-backed /dev/shm (DataLoader workers, NCCL); below memoryPerWorker",
        check=_size,
    )
    storage_class: str = knob(
        REQUIRED,
        "StorageClass of the volumes; must support ReadWriteMany (NFS, CephFS, EFS, "
        "Filestore...); empty = cluster default",
        check=_storage_class,
    )
    datasets_size: str = knob(
        REQUIRED, "size of the datasets volume, mounted at /workspace/data", check=_size
    )
    checkpoints_size: str = knob(
        REQUIRED, "size of the checkpoints volume, mounted at /workspace/checkpoints", check=_size
    )
    logs_size: str = knob(
        REQUIRED, "size of the TensorBoard logs volume, mounted at /workspace/logs", check=_size
    )
    tensorboard_cpu: str = knob(REQUIRED, "CPU for TensorBoard (requests = limits)", check=_cpu)
    tensorboard_memory: str = knob(
        REQUIRED, "memory for TensorBoard (requests = limits)", check=_size
    )
    price_per_gpu_hour: str = knob(
        REQUIRED,
        "what one GPU-hour costs you, a decimal number, for the cost line of `make up` "
        "(0 = unknown)",
        check=_price,
    )
    price_currency: str = knob(
        REQUIRED, "currency of pricePerGpuHour, three letters", check=_currency
    )
    # Secrets: set with `pulumi config set --secret`, refused in plain text, never in a repr.
    ssh_authorized_keys: str = knob(
        REQUIRED,
        "your OpenSSH public key(s), one per line, set with `pulumi config set --secret "
        "sshAuthorizedKeys < ~/.ssh/id_ed25519.pub`",
        check=_ssh_authorized_keys,
        secret=True,
    )
    alert_webhooks: str = knob(
        REQUIRED,
        "value of CLIPFORGE_ALERT_WEBHOOKS on the workers (comma-separated feishu:URL, lark:URL, "
        "slack:URL or URL, as docs/alerts.md describes); set with --secret; empty = no alerts",
        check=_alert_webhooks,
        secret=True,
    )
    registry_auth: str = knob(
        REQUIRED,
        "Docker config.json with pull credentials for a private REGISTRY, set with --secret "
        "(`pulumi config set --secret registryAuth < config.json`); empty = public image",
        check=_registry_auth,
        secret=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        # A memory-backed emptyDir is charged to the container's memory limit: /dev/shm as large
        # as the limit would leave nothing for the trainer itself.
        if parse_bytes(self.shm_size) >= parse_bytes(self.memory_per_worker):
            raise _problem(
                full_key("shmSize"),
                f"{self.shm_size} must be smaller than memoryPerWorker "
                f"({self.memory_per_worker}): /dev/shm is memory-backed and counts against the "
                "worker's memory limit",
            )


@dataclass(frozen=True)
class Declaration:
    """One key as StackConfig declares it, in Pulumi.yaml's terms."""

    key: str
    type: str  # Pulumi.yaml's: string, integer, boolean, array
    doc: str
    secret: bool


_PULUMI_TYPES = {str: "string", int: "integer", bool: "boolean", list: "array"}


def _pulumi_type(hint: Any) -> str:
    """Pulumi.yaml's type of a field's type hint; a Literal of strings (a choice) is a string,
    Pulumi.yaml having no enums."""
    if typing.get_origin(hint) is Literal:
        assert all(isinstance(choice, str) for choice in typing.get_args(hint)), hint
        return "string"
    return _PULUMI_TYPES[typing.get_origin(hint) or hint]


def declarations() -> tuple[Declaration, ...]:
    """Every key as StackConfig declares it, in its (and Pulumi.yaml's) order."""
    hints = typing.get_type_hints(StackConfig)
    return tuple(
        Declaration(
            key=pulumi_key(f.name),
            type=_pulumi_type(hints[f.name]),
            doc=f.metadata["doc"],
            secret=bool(f.metadata.get("secret")),
        )
        for f in dataclasses.fields(StackConfig)
    )


# Every key Pulumi.yaml declares (tests keep the two in step), and those stored encrypted.
CONFIG_KEYS = tuple(declared.key for declared in declarations())
SECRET_KEYS = tuple(declared.key for declared in declarations() if declared.secret)


def declaration_problems(
    pulumi_config: Mapping[str, Any], declared: tuple[Declaration, ...] | None = None
) -> list[str]:
    """One line per way Pulumi.yaml's `config` mapping (key -> {type, description, default})
    and StackConfig's declarations disagree: a key only one of them has or one declared twice,
    another type, an empty doc, a description that is not the doc."""
    declared = declarations() if declared is None else declared
    keys = [declaration.key for declaration in declared]
    problems = [
        f"{key}: in Pulumi.yaml, not declared in StackConfig (clipforge_infra/settings.py)"
        for key in pulumi_config
        if key not in keys
    ]
    problems += [
        f"{key}: declared {keys.count(key)} times"
        for key in dict.fromkeys(keys)
        if keys.count(key) > 1
    ]
    for declaration in declared:
        key, spec = declaration.key, pulumi_config.get(declaration.key)
        if not isinstance(spec, dict):
            problems.append(f"{key}: declared in StackConfig, missing from Pulumi.yaml's config")
            continue
        if not declaration.doc.strip():
            problems.append(f"{key}: StackConfig's doc is empty")
        elif "description" not in spec:
            problems.append(f"{key}: no description in Pulumi.yaml; its doc is: {declaration.doc}")
        elif spec["description"] != declaration.doc:
            problems.append(
                f"{key}: Pulumi.yaml's description is not StackConfig's doc; "
                "`python -m clipforge_infra.settings --write` (in infra/) writes it"
            )
        if spec.get("type") != declaration.type:
            problems.append(
                f"{key}: Pulumi.yaml's type is {spec.get('type')!r}, StackConfig's "
                f"{declaration.type!r}"
            )
    return problems


_PULUMI_YAML_KEY_RE = re.compile(r"^  ([A-Za-z][A-Za-z0-9]*):\s*$")


def described(pulumi_yaml: str) -> str:
    """Pulumi.yaml's text with the `description:` line of each declared key written from its doc;
    every other line as it was. `python -m clipforge_infra.settings --write` applies it."""
    docs = {declared.key: declared.doc for declared in declarations()}
    lines, key, in_config = [], None, False
    for line in pulumi_yaml.splitlines():
        if line and not line.startswith((" ", "#")):
            in_config, key = line.startswith("config:"), None
        elif in_config and (match := _PULUMI_YAML_KEY_RE.match(line)):
            key = match.group(1)
        elif key in docs and line.startswith("    description:"):
            dumped = yaml.safe_dump({"description": docs[key]}, width=2**31, allow_unicode=True)
            line = "    " + dumped.strip()
        lines.append(line)
    return "\n".join(lines) + "\n"


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
    run_mode: str  # contract.RUN_MODES: "workers" (SSH workers) or "jobs" (a run is a Job)
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

    @property
    def has_workers(self) -> bool:
        """Whether the stack runs its SSH workers now: up, and in `workers` mode."""
        return not self.released and self.run_mode == RUN_MODE_WORKERS


def read_config(config: Any) -> dict[str, Any]:
    """Every declared key read from `config` (a pulumi.Config) with the typed getter of its
    type, so nothing here parses text Pulumi has already typed. The Pulumi CLI checks the stack's
    values against Pulumi.yaml's types first: a ConfigTypeError from a getter (a RunError,
    reported without a traceback) means the program ran outside the CLI."""
    getters = {
        "string": config.get,
        "integer": config.get_int,
        "boolean": config.get_bool,
        "array": config.get_object,
    }
    return {declared.key: getters[declared.type](declared.key) for declared in declarations()}


def parse_settings(
    values: Mapping[str, Any], secret_keys: frozenset[str] | set[str]
) -> StackSettings:
    """Validate the config (key without project prefix -> value as Pulumi's typed Config returns
    it, None when unset); `secret_keys`: the keys stored encrypted."""
    unknown = sorted(set(values) - set(CONFIG_KEYS))
    if unknown:
        raise _problem(
            full_key(unknown[0]), f"unknown key; Pulumi.yaml declares: {', '.join(CONFIG_KEYS)}"
        )
    for declaration in declarations():
        key, value = declaration.key, values.get(declaration.key)
        if value is None:
            raise _problem(full_key(key), _missing(key, declaration))
        if declaration.secret and value and key not in secret_keys:
            # The value is already in the stack file in clear; say so without repeating it.
            raise _problem(
                full_key(key),
                f"stored in plain text; remove it (`pulumi config rm {key}`) and set it "
                f"encrypted with `pulumi config set --secret {key} ...`",
            )
    config = StackConfig(
        **{f.name: values[pulumi_key(f.name)] for f in dataclasses.fields(StackConfig)}
    )
    return _settings(config)


def _missing(key: str, declaration: Declaration) -> str:
    if key == "image":
        return (
            "no image set: `make up` sets it from docker/image.env "
            "(plus $REGISTRY); to pin another, `pulumi config set image REPO:TAG`"
        )
    if declaration.secret:
        return f"not set: `pulumi config set --secret {key} ...` (see infra/README.md)"
    return (
        "no value: Pulumi.yaml declares its default, so the program must be run "
        "by the Pulumi CLI (make up / make preview), not on its own"
    )


def _settings(config: StackConfig) -> StackSettings:
    sizes = {
        "datasetsSize": config.datasets_size,
        "checkpointsSize": config.checkpoints_size,
        "logsSize": config.logs_size,
    }
    return StackSettings(
        kube_context=config.kube_context,
        namespace=config.namespace,
        released=config.released,
        run_mode=config.run_mode,
        image=config.image,
        workers=WorkerSettings(
            num_workers=config.num_workers,
            gpus_per_worker=config.gpus_per_worker,
            gpu_resource_name=config.gpu_resource_name,
            node_selector=node_selector(full_key("gpuNodeSelector"), config.gpu_node_selector),
            tolerations=tolerations(full_key("gpuTolerations"), config.gpu_tolerations),
            cpu=config.cpu_per_worker,
            memory=config.memory_per_worker,
            shm_size=config.shm_size,
        ),
        storage=StorageSettings(
            storage_class=config.storage_class,
            sizes={volume.role: sizes[volume.size_key] for volume in VOLUMES},
        ),
        tensorboard=TensorBoardSettings(
            cpu=config.tensorboard_cpu, memory=config.tensorboard_memory
        ),
        price_per_gpu_hour=Decimal(config.price_per_gpu_hour),
        price_currency=config.price_currency,
        secrets=SecretSettings(
            ssh_authorized_keys=config.ssh_authorized_keys,
            alert_webhooks=config.alert_webhooks,
            registry_auth=config.registry_auth,
        ),
    )


def main(argv: list[str]) -> int:
    """`--write`: rewrite infra/Pulumi.yaml's descriptions from the docs above (after editing
    one); `--check`: exit 1 naming each disagreement, as tests/infra does."""
    path = Path(__file__).resolve().parent.parent / "Pulumi.yaml"
    text = path.read_text(encoding="utf-8")
    if argv == ["--write"]:
        path.write_text(described(text), encoding="utf-8")
        text = path.read_text(encoding="utf-8")
    elif argv != ["--check"]:
        print("usage: python -m clipforge_infra.settings --write | --check", file=sys.stderr)
        return 2
    problems = declaration_problems(yaml.safe_load(text).get("config") or {})
    for problem in problems:
        print(f"{path}: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
