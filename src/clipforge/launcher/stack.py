"""The stack outputs file that `make up` writes (infra/stack-outputs.json), read defensively.

Keys relied on (see infra/README.md): `released`, `workers[].host`, `ssh.user`, `ssh.port`,
`ssh.host_public_key`, `gpus_per_worker`, `volumes.<role>.mount_path` (datasets, checkpoints,
logs), `tensorboard.service`/`.port`, `cost.price_per_gpu_hour` (a decimal string), `image`,
`namespace`. Anything missing or of the wrong type is reported by its key, with what to do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from clipforge.errors import LauncherError

# The stack's `run_mode` output (infra/clipforge_infra/contract.py is its home): `jobs` means no
# SSH workers, each `fab train` is a Kubernetes Job of its own (clipforge.launcher.kubernetes).
RUN_MODE_JOBS = "jobs"
LAUNCH_LABEL = "clipforge/launch-id"  # on every object (and pod) of a run on the cluster


def runs_jobs(raw: Any) -> bool:
    """Whether stack outputs say runs are Kubernetes Jobs (runMode jobs); outputs without the
    key have workers."""
    return isinstance(raw, dict) and raw.get("run_mode") == RUN_MODE_JOBS


def jobs_stack_hint(namespace: str, launch_id: str | None = None) -> str:
    """What to use instead of the SSH workers on a jobs stack, in one line."""
    launch = launch_id or "ID"
    where = f"kubectl -n {namespace or '<namespace>'}"
    return (
        f"the stack runs each run as a Kubernetes Job (runMode: jobs) and has no SSH workers: "
        f"read a run with `fab status --launch {launch}` (or `fab fetch`, `fab tensorboard`; from the "
        f"run store: storage.remote, or --store URL), its output with "
        f"`{where} logs -l {LAUNCH_LABEL}={launch}`, stop it with "
        f"`{where} delete job -l {LAUNCH_LABEL}={launch}` (several nodes: `delete jobset`; it "
        f"checkpoints first); "
        f"or give hosts with -H"
    )


@dataclass(frozen=True)
class StackOutputs:
    path: Path
    namespace: str
    worker_hosts: tuple[str, ...]
    ssh_user: str
    ssh_port: int
    host_public_key: str | None  # pins the workers' host key: no trust-on-first-use needed
    gpus_per_worker: int
    mount_paths: dict[str, str]  # role (datasets, checkpoints, logs) -> path inside the workers
    tensorboard_host: str | None
    tensorboard_port: int | None
    price_per_gpu_hour: Decimal | None
    image: str | None


def load_stack_outputs(path: Path) -> StackOutputs:
    """Parse the outputs file; LauncherError naming the key when something is off."""
    if not path.is_file():
        raise LauncherError(
            f"no hosts: give them with -H user@host[:port] (and -i key), or create a "
            f"stack with `make up`, which writes {path}"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise LauncherError(
            f"{path}: not readable JSON ({exc}); rerun `make up` to rewrite it"
        ) from None
    return parse_stack_outputs(raw, path)


def parse_stack_outputs(raw: Any, path: Path) -> StackOutputs:
    """The outputs (`pulumi stack output --json`, read from `path`), checked key by key."""
    if not isinstance(raw, dict):
        raise LauncherError(
            f"{path}: expected a JSON object (pulumi stack output --json); rerun `make up`"
        )
    if runs_jobs(raw):
        namespace = raw.get("namespace")
        raise LauncherError(
            f"{path}: " + jobs_stack_hint(namespace if isinstance(namespace, str) else "")
        )
    if raw.get("released") is True:
        raise LauncherError(
            f"{path}: the stack is released (`make down` ran): no workers to use; "
            f"`make up` brings them back, or give hosts with -H"
        )
    workers = _get(raw, path, "workers", list)
    hosts = []
    for index, worker in enumerate(workers):
        host = worker.get("host") if isinstance(worker, dict) else None
        if not isinstance(host, str) or not host:
            raise LauncherError(f"{path}: workers[{index}].host missing; rerun `make up`")
        hosts.append(host)
    if not hosts:
        raise LauncherError(
            f"{path}: the stack has no workers; `make up` with num_workers >= 1, or -H"
        )
    namespace = raw.get("namespace")
    ssh = _get(raw, path, "ssh", dict)
    volumes = v if isinstance(v := raw.get("volumes"), dict) else {}
    mounts = {
        role: spec["mount_path"]
        for role, spec in volumes.items()
        if isinstance(spec, dict) and isinstance(spec.get("mount_path"), str)
    }
    tensorboard = t if isinstance(t := raw.get("tensorboard"), dict) else {}
    tb_service = tensorboard.get("service")
    tb_host = f"{tb_service}.{namespace}.svc" if tb_service and namespace else tb_service
    return StackOutputs(
        path=path,
        namespace=namespace if isinstance(namespace, str) else "",
        worker_hosts=tuple(hosts),
        ssh_user=_get(ssh, path, "ssh.user", str, key="user"),
        ssh_port=_get(ssh, path, "ssh.port", int, key="port"),
        host_public_key=ssh.get("host_public_key")
        if isinstance(ssh.get("host_public_key"), str)
        else None,
        gpus_per_worker=_get(raw, path, "gpus_per_worker", int),
        mount_paths=mounts,
        tensorboard_host=tb_host,
        tensorboard_port=tensorboard.get("port")
        if isinstance(tensorboard.get("port"), int)
        else None,
        price_per_gpu_hour=_price(raw, path),
        image=raw.get("image") if isinstance(raw.get("image"), str) else None,
    )


def _get(mapping: dict, path: Path, name: str, kind: type, key: str | None = None) -> Any:
    value = mapping.get(key or name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise LauncherError(
            f"{path}: `{name}` missing or not a {kind.__name__} (got {value!r}); "
            f"rerun `make up` (the launcher and infra/ may be out of step)"
        )
    return value


def _price(raw: dict, path: Path) -> Decimal | None:
    cost = raw.get("cost")
    if not isinstance(cost, dict) or cost.get("price_per_gpu_hour") in (None, ""):
        return None
    try:
        return Decimal(str(cost["price_per_gpu_hour"]))
    except InvalidOperation:
        raise LauncherError(
            f"{path}: cost.price_per_gpu_hour is not a number: {cost['price_per_gpu_hour']!r}"
        ) from None
