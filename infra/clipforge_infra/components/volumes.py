"""Retained storage: the namespace and the ReadWriteMany claims for datasets, checkpoints and logs.

How the data survives `make down`: `make down` does not destroy the stack. It runs `pulumi up` with
``released=true``, which deletes the GPU workers and TensorBoard and leaves this component in the
stack, so a later `make up` re-attaches the very same claims. Every object here is also created with
``protect=True``: the one command that could delete them, `pulumi destroy`, fails on a protected
resource instead of deleting it (and deleting the namespace would delete every claim in it).

Rejected alternative: ``retain_on_delete``. It forgets the objects from the state while leaving them
in the cluster, and since pulumi-kubernetes 4.29 creating an object that already exists fails, so the
next `make up` could not re-create (re-attach) them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from ..contract import VOLUMES
from ..labels import labels
from ..settings import StorageSettings


@dataclass(frozen=True)
class StorageArgs:
    namespace: str
    storage: StorageSettings


class RetainedStorage(pulumi.ComponentResource):
    """Namespace + one ReadWriteMany PersistentVolumeClaim per volume role, all protected."""

    namespace: pulumi.Output[str]
    claims: dict[str, k8s.core.v1.PersistentVolumeClaim]

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("clipforge:infra:RetainedStorage", name, None, opts)
        retained = pulumi.ResourceOptions(parent=self, protect=True)
        namespace = k8s.core.v1.Namespace(
            f"{name}-namespace",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=args.namespace, labels=labels("storage")),
            opts=retained,
        )
        self.namespace = namespace.metadata.name
        self.claims = {}
        for volume in VOLUMES:
            spec = k8s.core.v1.PersistentVolumeClaimSpecArgs(
                access_modes=["ReadWriteMany"],
                resources=k8s.core.v1.VolumeResourceRequirementsArgs(
                    requests={"storage": args.storage.sizes[volume.role]}
                ),
                # None lets the cluster's default StorageClass decide; it must support ReadWriteMany.
                storage_class_name=args.storage.storage_class
                if args.storage.storage_class
                else None,
            )
            self.claims[volume.role] = k8s.core.v1.PersistentVolumeClaim(
                f"{name}-{volume.role}",
                metadata=k8s.meta.v1.ObjectMetaArgs(
                    name=volume.claim_name,
                    namespace=self.namespace,
                    labels=labels("storage"),
                    # With a WaitForFirstConsumer StorageClass a claim stays Pending until a pod uses
                    # it; waiting for Bound here would dead-lock against the workers that use it.
                    annotations={"pulumi.com/skipAwait": "true"},
                ),
                spec=spec,
                opts=retained,
            )
        self.register_outputs(
            {
                "namespace": self.namespace,
                "claims": {role: claim.metadata.name for role, claim in self.claims.items()},
            }
        )
