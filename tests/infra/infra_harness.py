"""Runs infra/__main__.py under Pulumi's mocks and records every resource it registers.

The mock monitor below sees each RegisterResource request as the engine would: type, name, parent,
resource options (protect) and inputs with secrets still wrapped, so tests can assert on all four.
Config is built the way the Pulumi CLI builds it: the stack file's values, else Pulumi.yaml's
defaults, plus the image `make up` passes from docker/image.env.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
INFRA_DIR = REPO / "infra"
if str(INFRA_DIR) not in sys.path:
    sys.path.insert(0, str(INFRA_DIR))

import pulumi  # noqa: E402
from pulumi.runtime import rpc, settings  # noqa: E402
from pulumi.runtime.mocks import MockMonitor  # noqa: E402
from pulumi.runtime.stack import run_pulumi_func  # noqa: E402
from pulumi.runtime.sync_await import _sync_await  # noqa: E402

from clipforge.image_env import read_image_env  # noqa: E402
from clipforge_infra.contract import PROJECT  # noqa: E402
from clipforge_infra.settings import read_config  # noqa: E402
from clipforge_infra.stack_files import load_declarations, load_stack_values, program_config  # noqa: E402

SECRET_SIG = rpc._special_secret_sig  # the marker Pulumi puts on secret values on the wire
SIG_KEY = rpc._special_sig_key
# A syntactically valid OpenSSH public key (not anyone's): what `pulumi config set --secret` would hold.
USER_PUBLIC_KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGd0ZXN0a2V5Zm9yY2xpcGZvcmdlaW5mcmF0ZXN0cw user@laptop"
)
WEBHOOKS = "feishu:https://open.feishu.cn/open-apis/bot/v2/hook/abc,https://hooks.example.org/x"
# A Docker config.json as `docker login` writes it without a credential helper (user:password, base64).
REGISTRY_AUTH = '{"auths": {"registry.example": {"auth": "dXNlcjpwYXNzd29yZA=="}}}'
# What the tls provider would return for a generated ED25519 key.
TLS_OUTPUTS = {
    "privateKeyOpenssh": "-----BEGIN OPENSSH PRIVATE KEY-----\nmock\n-----END OPENSSH PRIVATE KEY-----\n",
    "publicKeyOpenssh": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG1vY2tob3N0a2V5Zm9ydGVzdHNvbmx5MDAwMDAw\n",
}


def is_secret(value: Any) -> bool:
    return isinstance(value, dict) and value.get(SIG_KEY) == SECRET_SIG


def reveal(value: Any) -> Any:
    """The value as the API server would receive it: secrets unwrapped, integral numbers as ints."""
    if is_secret(value):
        return reveal(value["value"])
    if isinstance(value, dict):
        return {key: reveal(item) for key, item in value.items()}
    if isinstance(value, list):
        return [reveal(item) for item in value]
    # Numbers cross the wire as doubles; the provider sends integral ones to the API server as ints.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass
class Registered:
    type: str
    name: str
    urn: str
    parent: str
    protect: bool
    custom: bool
    inputs: dict


@dataclass
class ProgramRun:
    resources: list[Registered] = field(default_factory=list)
    outputs: dict = field(default_factory=dict)

    def of_type(self, type_: str) -> list[Registered]:
        return [resource for resource in self.resources if resource.type == type_]

    def one(self, type_: str) -> Registered:
        found = self.of_type(type_)
        assert len(found) == 1, f"expected one {type_}, found {len(found)}"
        return found[0]

    def kubernetes_objects(self) -> list[dict]:
        """Every Kubernetes object as it would be sent to the API server."""
        return [
            reveal(r.inputs)
            for r in self.resources
            if r.custom
            and r.type.startswith("kubernetes:")
            and not r.type.startswith("pulumi:providers:")
        ]

    def pod_specs(self) -> list[dict]:
        return [
            obj["spec"]["template"]["spec"]
            for obj in self.kubernetes_objects()
            if obj["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job")
        ]


class _Mocks(pulumi.runtime.Mocks):
    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        state = dict(args.inputs)
        if args.typ == "tls:index/privateKey:PrivateKey":
            state.update(TLS_OUTPUTS)
        return f"{args.name}-id", state

    def call(self, args: pulumi.runtime.MockCallArgs):
        return {}, None


class _RecordingMonitor(MockMonitor):
    def __init__(self, mocks: pulumi.runtime.Mocks):
        super().__init__(mocks)
        self.registered: list[Registered] = []

    def RegisterResource(self, request):  # noqa: N802  (the gRPC servicer's method name)
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            self.registered.append(
                Registered(
                    type=request.type,
                    name=request.name,
                    urn=response.urn,
                    parent=request.parent,
                    protect=bool(request.protect),
                    custom=bool(request.custom),
                    inputs=rpc.deserialize_properties(request.object, keep_unknowns=True),
                )
            )
        return response


def make_up_image() -> str:
    """The image `make up` passes when the stack sets none (no REGISTRY)."""
    return read_image_env(REPO / "docker" / "image.env").reference()


def stack_config(
    stack: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    secrets: Mapping[str, str] | None = None,
) -> tuple[dict[str, str | None], set[str]]:
    """(config, secret keys) as the CLI would hand them to the program for ``make up STACK=stack``.

    ``overrides`` set plain keys (None removes one); ``secrets`` set keys with --secret. By default
    the SSH key and webhooks are set as secrets and the image as `make up` would set it.
    """
    values: dict[str, Any] = dict(load_stack_values(INFRA_DIR, stack)) if stack else {}
    values.setdefault("image", make_up_image())
    secret_values = {"sshAuthorizedKeys": USER_PUBLIC_KEY, "alertWebhooks": WEBHOOKS}
    secret_values.update(secrets or {})
    values.update(secret_values)
    for key, value in (overrides or {}).items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    config = program_config(load_declarations(INFRA_DIR), values)
    secret_keys = {key for key in secret_values if key not in (overrides or {})}
    return config, secret_keys


def _set_config(config: Mapping[str, str | None], secret_keys: set[str]) -> None:
    pulumi.runtime.set_all_config(
        {f"{PROJECT}:{key}": value for key, value in config.items() if value is not None},
        [f"{PROJECT}:{key}" for key in secret_keys],
    )


def program_values(config: Mapping[str, str | None], secret_keys: set[str]) -> dict[str, Any]:
    """What infra/__main__.py hands parse_settings for this config: each key read through
    Pulumi's typed Config, as the program reads it."""
    _set_config(config, secret_keys)
    return read_config(pulumi.Config(PROJECT))


def run_program(
    config: Mapping[str, str | None], secret_keys: set[str], stack: str = "test"
) -> ProgramRun:
    """Run infra/__main__.py under mocks; raises what the program raises (e.g. pulumi.RunError)."""
    settings.ROOT.set(None)  # a fresh root stack: outputs of earlier runs must not leak
    mocks = _Mocks()
    monitor = _RecordingMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=stack, preview=False, monitor=monitor)
    _set_config(config, secret_keys)
    run = ProgramRun()

    def program():
        runpy.run_path(str(INFRA_DIR / "__main__.py"), run_name="__main__")

    _sync_await(run_pulumi_func(program))
    root = pulumi.runtime.get_root_resource()
    run.outputs = _sync_await(pulumi.Output.from_input(root.outputs).future())
    run.resources = monitor.registered
    return run
