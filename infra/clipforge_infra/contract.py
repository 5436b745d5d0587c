"""The fixed contract between the stack, the training image and the launcher.

These are not configuration: the train stage, the image's entrypoint and the Fabric launcher all
rely on them, so changing one means changing all three.
"""

from __future__ import annotations

from dataclasses import dataclass

PROJECT = "clipforge-infra"

# Mount paths inside worker pods (and TensorBoard), fixed so that a run's paths do not depend on
# the stack it runs on.
DATASETS_MOUNT_PATH = "/workspace/data"
CHECKPOINTS_MOUNT_PATH = "/workspace/checkpoints"
LOGS_MOUNT_PATH = "/workspace/logs"
# POSIX shared memory for DataLoader workers and NCCL; the container runtime's default is 64 MiB.
SHM_MOUNT_PATH = "/dev/shm"

# The image's entrypoint starts sshd when CLIPFORGE_SSHD=1, as the non-root user, on a port above
# 1024 (no capability needed), reading keys from this directory.
SSHD_ENV = "CLIPFORGE_SSHD"
SSH_PORT = 2222
SSH_KEYS_MOUNT_PATH = "/etc/clipforge/ssh"
SSH_USER = "clipforge"
RUN_AS_UID = 1000
RUN_AS_GID = 1000

# Alert webhooks reach the workers (and the train stage's monitor) through this variable.
ALERT_WEBHOOKS_ENV = "CLIPFORGE_ALERT_WEBHOOKS"

TENSORBOARD_PORT = 6006

# How runs reach the GPUs (the stack's `runMode`): over SSH on the stack's idle workers, or each
# as a Kubernetes Job/JobSet of its own (`fab train` reads it from the outputs' `run_mode`).
RUN_MODE_WORKERS = "workers"
RUN_MODE_JOBS = "jobs"
RUN_MODES = (RUN_MODE_WORKERS, RUN_MODE_JOBS)
# The app.kubernetes.io/component label of the pods the launcher makes for a run (runMode jobs):
# the stack's NetworkPolicy for them selects it.
RUN_COMPONENT = "run"

# Kubernetes object names inside the stack's namespace. Fixed (no Pulumi auto-naming) so that worker
# host names are known before the stack exists: <WORKER_STATEFULSET>-<i>.<WORKER_SERVICE>.<ns>.
WORKER_STATEFULSET = "clipforge-worker"
WORKER_SERVICE = "clipforge-workers"
TENSORBOARD_NAME = "clipforge-tensorboard"
SSH_SECRET = "clipforge-ssh"
ALERTS_SECRET = "clipforge-alerts"
REGISTRY_SECRET = "clipforge-registry"


@dataclass(frozen=True)
class VolumeSpec:
    """One retained volume: its claim name, where it is mounted, which size key configures it."""

    role: str
    claim_name: str
    mount_path: str
    size_key: str


VOLUMES = (
    VolumeSpec("datasets", "clipforge-datasets", DATASETS_MOUNT_PATH, "datasetsSize"),
    VolumeSpec("checkpoints", "clipforge-checkpoints", CHECKPOINTS_MOUNT_PATH, "checkpointsSize"),
    VolumeSpec("logs", "clipforge-logs", LOGS_MOUNT_PATH, "logsSize"),
)


def worker_pod_name(index: int) -> str:
    return f"{WORKER_STATEFULSET}-{index}"


def worker_host(index: int, namespace: str) -> str:
    """The stable DNS name the headless Service gives worker ``index``."""
    return f"{worker_pod_name(index)}.{WORKER_SERVICE}.{namespace}.svc.cluster.local"
