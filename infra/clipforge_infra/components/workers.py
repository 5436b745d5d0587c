"""GPU workers: a StatefulSet of identical pods, one per GPU node, reachable over SSH.

The headless Service gives each pod a stable DNS name (clipforge-worker-<i>.clipforge-workers.<ns>
.svc.cluster.local), which is what a DeepSpeed hostfile and NCCL rendezvous need. Pods run the image's
entrypoint with CLIPFORGE_SSHD=1 (sshd on port 2222, keys from /etc/clipforge/ssh) and then idle:
training runs are started over SSH by the launcher, so a run ending never restarts a pod.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from ..contract import (
    ALERT_WEBHOOKS_ENV,
    SHM_MOUNT_PATH,
    SSH_KEYS_MOUNT_PATH,
    SSH_PORT,
    SSHD_ENV,
    VOLUMES,
    WORKER_SERVICE,
    WORKER_STATEFULSET,
)
from ..labels import labels, selector
from ..settings import WorkerSettings
from .pod_security import container_security_context, pod_security_context, pull_secrets

COMPONENT = "worker"
# Secret files are root-owned; 0440 with fsGroup lets the non-root user read them while sshd's
# "unprotected private key" check (which applies to files the user owns) does not trip.
SECRET_FILE_MODE = 0o440
# Pulling a CUDA image of several GB onto a GPU node that the autoscaler is still adding takes longer
# than Pulumi's default 10 minutes.
ROLLOUT_TIMEOUT = "30m"


@dataclass(frozen=True)
class WorkersArgs:
    namespace: pulumi.Input[str]
    image: str
    workers: WorkerSettings
    ssh_secret_name: pulumi.Input[str]
    alerts_secret_name: pulumi.Input[str]
    pull_secret_name: pulumi.Input[str] | None  # None: the image is public


class GpuWorkers(pulumi.ComponentResource):
    """Headless Service + StatefulSet + PodDisruptionBudget for ``num_workers`` GPU pods."""

    service_name: pulumi.Output[str]
    statefulset_name: pulumi.Output[str]

    def __init__(self, name: str, args: WorkersArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("clipforge:infra:GpuWorkers", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        metadata = dict(namespace=args.namespace, labels=labels(COMPONENT))

        service = k8s.core.v1.Service(
            f"{name}-service",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=WORKER_SERVICE, **metadata),
            spec=k8s.core.v1.ServiceSpecArgs(
                cluster_ip="None",
                selector=selector(COMPONENT),
                # Peers must resolve each other while they start, before any of them is Ready.
                publish_not_ready_addresses=True,
                ports=[
                    k8s.core.v1.ServicePortArgs(name="ssh", port=SSH_PORT, target_port=SSH_PORT)
                ],
            ),
            opts=child,
        )
        statefulset = k8s.apps.v1.StatefulSet(
            f"{name}-statefulset",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=WORKER_STATEFULSET, **metadata),
            spec=k8s.apps.v1.StatefulSetSpecArgs(
                service_name=service.metadata.name,
                replicas=args.workers.num_workers,
                # All workers start together; a multi-node run needs every one of them anyway.
                pod_management_policy="Parallel",
                selector=k8s.meta.v1.LabelSelectorArgs(match_labels=selector(COMPONENT)),
                template=k8s.core.v1.PodTemplateSpecArgs(
                    metadata=k8s.meta.v1.ObjectMetaArgs(labels=labels(COMPONENT)),
                    spec=_pod_spec(args),
                ),
            ),
            opts=pulumi.ResourceOptions(
                parent=self,
                custom_timeouts=pulumi.CustomTimeouts(
                    create=ROLLOUT_TIMEOUT, update=ROLLOUT_TIMEOUT
                ),
            ),
        )
        # A multi-node run dies when any worker goes: refuse every voluntary eviction (node drains,
        # autoscaler scale-down) while the workers exist. `make down` deletes the StatefulSet, which
        # is not an eviction, so the budget never blocks it.
        k8s.policy.v1.PodDisruptionBudget(
            f"{name}-pdb",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=WORKER_STATEFULSET, **metadata),
            spec=k8s.policy.v1.PodDisruptionBudgetSpecArgs(
                max_unavailable=0,
                selector=k8s.meta.v1.LabelSelectorArgs(match_labels=selector(COMPONENT)),
            ),
            opts=child,
        )
        self.service_name = service.metadata.name
        self.statefulset_name = statefulset.metadata.name
        self.register_outputs(
            {"service_name": self.service_name, "statefulset_name": self.statefulset_name}
        )


def _pod_spec(args: WorkersArgs) -> k8s.core.v1.PodSpecArgs:
    workers = args.workers
    gpus = str(workers.gpus_per_worker)
    resources = {"cpu": workers.cpu, "memory": workers.memory, workers.gpu_resource_name: gpus}
    volumes = [
        k8s.core.v1.VolumeArgs(
            name=volume.role,
            persistent_volume_claim=k8s.core.v1.PersistentVolumeClaimVolumeSourceArgs(
                claim_name=volume.claim_name
            ),
        )
        for volume in VOLUMES
    ]
    volumes += [
        k8s.core.v1.VolumeArgs(
            name="dshm",
            empty_dir=k8s.core.v1.EmptyDirVolumeSourceArgs(
                medium="Memory", size_limit=workers.shm_size
            ),
        ),
        k8s.core.v1.VolumeArgs(
            name="ssh-keys",
            secret=k8s.core.v1.SecretVolumeSourceArgs(
                secret_name=args.ssh_secret_name, default_mode=SECRET_FILE_MODE
            ),
        ),
    ]
    mounts = [
        k8s.core.v1.VolumeMountArgs(name=volume.role, mount_path=volume.mount_path)
        for volume in VOLUMES
    ]
    mounts += [
        k8s.core.v1.VolumeMountArgs(name="dshm", mount_path=SHM_MOUNT_PATH),
        k8s.core.v1.VolumeMountArgs(
            name="ssh-keys", mount_path=SSH_KEYS_MOUNT_PATH, read_only=True
        ),
    ]
    env = [
        k8s.core.v1.EnvVarArgs(name=SSHD_ENV, value="1"),
        k8s.core.v1.EnvVarArgs(
            name=ALERT_WEBHOOKS_ENV,
            value_from=k8s.core.v1.EnvVarSourceArgs(
                secret_key_ref=k8s.core.v1.SecretKeySelectorArgs(
                    name=args.alerts_secret_name, key=ALERT_WEBHOOKS_ENV
                )
            ),
        ),
    ] + [
        k8s.core.v1.EnvVarArgs(name=f"CLIPFORGE_{volume.role.upper()}_DIR", value=volume.mount_path)
        for volume in VOLUMES
    ]
    container = k8s.core.v1.ContainerArgs(
        name="worker",
        image=args.image,
        # The entrypoint starts sshd (CLIPFORGE_SSHD=1) and then runs this: the pod only hosts runs.
        args=["sleep", "infinity"],
        env=env,
        ports=[k8s.core.v1.ContainerPortArgs(name="ssh", container_port=SSH_PORT)],
        # Requests equal limits: Guaranteed QoS, so a training pod is the last to be evicted.
        resources=k8s.core.v1.ResourceRequirementsArgs(requests=resources, limits=resources),
        volume_mounts=mounts,
        # Ready = sshd accepts connections, which is what the launcher needs. No liveness probe: a
        # restart would kill a training run over a transient sshd hiccup.
        readiness_probe=k8s.core.v1.ProbeArgs(
            tcp_socket=k8s.core.v1.TCPSocketActionArgs(port=SSH_PORT),
            initial_delay_seconds=5,
            period_seconds=10,
        ),
        security_context=container_security_context(),
    )
    return k8s.core.v1.PodSpecArgs(
        containers=[container],
        volumes=volumes,
        node_selector=dict(workers.node_selector) if workers.node_selector else None,
        tolerations=[
            k8s.core.v1.TolerationArgs(**toleration.to_kubernetes())
            for toleration in workers.tolerations
        ]
        or None,
        # One worker per node: two workers sharing a node would share its GPUs' PCIe/NVLink and its
        # network card, and the GPU count per node would no longer be what the hostfile says.
        affinity=k8s.core.v1.AffinityArgs(
            pod_anti_affinity=k8s.core.v1.PodAntiAffinityArgs(
                required_during_scheduling_ignored_during_execution=[
                    k8s.core.v1.PodAffinityTermArgs(
                        label_selector=k8s.meta.v1.LabelSelectorArgs(
                            match_labels=selector(COMPONENT)
                        ),
                        topology_key="kubernetes.io/hostname",
                    )
                ]
            )
        ),
        security_context=pod_security_context(),
        image_pull_secrets=pull_secrets(args.pull_secret_name),
        automount_service_account_token=False,
        # Time for a run's SIGTERM handler to finish writing a checkpoint.
        termination_grace_period_seconds=120,
    )
