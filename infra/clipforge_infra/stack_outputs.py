"""The stack outputs: what `make up` writes to infra/stack-outputs.json for the launcher.

Built from the validated settings and the fixed contract (contract.py), so the shape is known without a
cluster; the keys are documented in infra/README.md and the launcher (fabfile) depends on them.
"""

from __future__ import annotations

from typing import Any

from .contract import (
    SSH_PORT,
    SSH_USER,
    TENSORBOARD_NAME,
    TENSORBOARD_PORT,
    VOLUMES,
    worker_host,
    worker_pod_name,
)
from .settings import StackSettings

OUTPUT_KEYS = (
    "namespace",
    "kube_context",
    "released",
    "run_mode",
    "image",
    "num_workers",
    "gpus_per_worker",
    "gpu_resource_name",
    "gpu_node_selector",
    "gpu_tolerations",
    "cpu_per_worker",
    "memory_per_worker",
    "shm_size",
    "workers",
    "ssh",
    "volumes",
    "tensorboard",
    "cost",
)


def describe_stack(
    settings: StackSettings, namespace: Any, ssh_host_public_key: Any
) -> dict[str, Any]:
    """Output name -> value (``namespace`` and the host key may be Pulumi Outputs)."""
    workers = settings.workers
    running = not settings.released
    hosts = (
        [
            {"pod": worker_pod_name(index), "host": worker_host(index, settings.namespace)}
            for index in range(workers.num_workers)
        ]
        if settings.has_workers
        else []
    )
    # What the stack holds while no run goes: in jobs mode a run's Job holds its GPUs, the stack
    # none (its cost is the run's, shown by `fab status`).
    gpus_held = settings.total_gpus if settings.has_workers else 0
    return {
        "namespace": namespace,
        "kube_context": settings.kube_context,
        "released": settings.released,
        # jobs: no SSH workers; `fab train` without -H makes each run a Job (JobSet) of its own.
        "run_mode": settings.run_mode,
        "image": settings.image,
        "num_workers": workers.num_workers if settings.has_workers else 0,
        "gpus_per_worker": workers.gpus_per_worker,
        "gpu_resource_name": workers.gpu_resource_name,
        # How a worker is scheduled: `fab train --kubernetes` gives its pods the same.
        "gpu_node_selector": dict(workers.node_selector),
        "gpu_tolerations": [t.to_kubernetes() for t in workers.tolerations],
        "cpu_per_worker": workers.cpu,
        "memory_per_worker": workers.memory,
        "shm_size": workers.shm_size,
        "workers": hosts,
        "ssh": {
            "user": SSH_USER,
            "port": SSH_PORT,
            # Outside the cluster the launcher port-forwards to this pod; inside, it uses the hosts.
            "entry_pod": worker_pod_name(0) if settings.has_workers else None,
            "host_public_key": ssh_host_public_key,
        },
        "volumes": {
            volume.role: {
                "claim": volume.claim_name,
                "mount_path": volume.mount_path,
                "retained": True,
            }
            for volume in VOLUMES
        },
        "tensorboard": {"service": TENSORBOARD_NAME, "port": TENSORBOARD_PORT} if running else None,
        "cost": {
            "currency": settings.price_currency,
            "price_per_gpu_hour": str(settings.price_per_gpu_hour),
            "gpus": gpus_held,
            "per_hour": str(settings.price_per_gpu_hour * gpus_held),
        },
    }
