"""TensorBoard: a Deployment reading the logs volume, and a ClusterIP Service for port-forwarding.

It runs the training image (which ships tensorboard), so no second image needs pinning. The Service is
not exposed outside the cluster: the launcher reaches it with `kubectl port-forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from ..contract import LOGS_MOUNT_PATH, TENSORBOARD_NAME, TENSORBOARD_PORT, VOLUMES
from ..labels import labels, selector
from ..settings import TensorBoardSettings, Toleration
from .pod_security import container_security_context, pod_security_context, pull_secrets

COMPONENT = "tensorboard"


@dataclass(frozen=True)
class TensorBoardArgs:
    namespace: pulumi.Input[str]
    image: str
    tensorboard: TensorBoardSettings
    # On clusters whose only nodes are tainted GPU nodes TensorBoard must tolerate the taint too;
    # tolerating does not pull it onto GPU nodes where CPU nodes exist.
    tolerations: tuple[Toleration, ...]
    pull_secret_name: pulumi.Input[str] | None  # None: the image is public


class TensorBoard(pulumi.ComponentResource):
    service_name: pulumi.Output[str]

    def __init__(
        self, name: str, args: TensorBoardArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("clipforge:infra:TensorBoard", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        metadata = dict(name=TENSORBOARD_NAME, namespace=args.namespace, labels=labels(COMPONENT))
        logs_claim = next(
            volume.claim_name for volume in VOLUMES if volume.mount_path == LOGS_MOUNT_PATH
        )
        resources = {"cpu": args.tensorboard.cpu, "memory": args.tensorboard.memory}
        container = k8s.core.v1.ContainerArgs(
            name="tensorboard",
            image=args.image,
            args=[
                "tensorboard",
                "--logdir",
                LOGS_MOUNT_PATH,
                "--host",
                "0.0.0.0",
                "--port",
                str(TENSORBOARD_PORT),
            ],
            ports=[k8s.core.v1.ContainerPortArgs(name="http", container_port=TENSORBOARD_PORT)],
            resources=k8s.core.v1.ResourceRequirementsArgs(requests=resources, limits=resources),
            volume_mounts=[
                k8s.core.v1.VolumeMountArgs(name="logs", mount_path=LOGS_MOUNT_PATH, read_only=True)
            ],
            readiness_probe=k8s.core.v1.ProbeArgs(
                http_get=k8s.core.v1.HTTPGetActionArgs(path="/", port=TENSORBOARD_PORT),
                initial_delay_seconds=5,
                period_seconds=10,
            ),
            security_context=container_security_context(),
        )
        k8s.apps.v1.Deployment(
            f"{name}-deployment",
            metadata=k8s.meta.v1.ObjectMetaArgs(**metadata),
            spec=k8s.apps.v1.DeploymentSpecArgs(
                replicas=1,
                selector=k8s.meta.v1.LabelSelectorArgs(match_labels=selector(COMPONENT)),
                template=k8s.core.v1.PodTemplateSpecArgs(
                    metadata=k8s.meta.v1.ObjectMetaArgs(labels=labels(COMPONENT)),
                    spec=k8s.core.v1.PodSpecArgs(
                        containers=[container],
                        volumes=[
                            k8s.core.v1.VolumeArgs(
                                name="logs",
                                persistent_volume_claim=k8s.core.v1.PersistentVolumeClaimVolumeSourceArgs(
                                    claim_name=logs_claim, read_only=True
                                ),
                            )
                        ],
                        tolerations=[
                            k8s.core.v1.TolerationArgs(**t.to_kubernetes())
                            for t in args.tolerations
                        ]
                        or None,
                        security_context=pod_security_context(),
                        image_pull_secrets=pull_secrets(args.pull_secret_name),
                        automount_service_account_token=False,
                    ),
                ),
            ),
            opts=child,
        )
        service = k8s.core.v1.Service(
            f"{name}-service",
            metadata=k8s.meta.v1.ObjectMetaArgs(**metadata),
            spec=k8s.core.v1.ServiceSpecArgs(
                type="ClusterIP",
                selector=selector(COMPONENT),
                ports=[
                    k8s.core.v1.ServicePortArgs(
                        name="http", port=TENSORBOARD_PORT, target_port=TENSORBOARD_PORT
                    )
                ],
            ),
            opts=child,
        )
        self.service_name = service.metadata.name
        self.register_outputs({"service_name": self.service_name})
