"""Who may connect to the stack's pods: a NetworkPolicy per kind of pod, so that no other pod of
the cluster reaches TensorBoard (the run's logs and samples), a worker's sshd or a run's
rendezvous (an unauthenticated store that whoever reaches it can join).

- TensorBoard accepts no connection. It is read through `kubectl port-forward`, which enters the
  pod through the pod's own loopback (the kubelet), where NetworkPolicies do not apply; so does
  the kubelet's readiness probe, from the node, which they always allow.
- The workers accept connections from the workers alone, on every port: SSH between them (the
  launcher hops from the entry worker, reached through its port-forward), the rendezvous
  (`--master-port`) and NCCL's and gloo's own ports.
- A run's pods (runMode jobs: the launcher's Jobs and JobSets) accept connections from run pods
  alone, for the same reasons.

Egress stays open (the run store, the registry, webhooks). A cluster whose network plugin does not
enforce NetworkPolicies ignores them (docs/launcher.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from ..contract import RUN_COMPONENT
from ..labels import labels, selector
from .tensorboard import COMPONENT as TENSORBOARD_COMPONENT
from .workers import COMPONENT as WORKER_COMPONENT

COMPONENT = "network-policy"
# Each kind of pod, and the kinds whose pods may connect to it (none: only the port-forward).
ALLOWED_PEERS = {
    TENSORBOARD_COMPONENT: (),
    WORKER_COMPONENT: (WORKER_COMPONENT,),
    RUN_COMPONENT: (RUN_COMPONENT,),
}


@dataclass(frozen=True)
class NetworkPoliciesArgs:
    namespace: pulumi.Input[str]


class NetworkPolicies(pulumi.ComponentResource):
    def __init__(
        self, name: str, args: NetworkPoliciesArgs, opts: pulumi.ResourceOptions | None = None
    ):
        super().__init__("clipforge:infra:NetworkPolicies", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        for component, peers in ALLOWED_PEERS.items():
            k8s.networking.v1.NetworkPolicy(
                f"{name}-{component}",
                metadata=k8s.meta.v1.ObjectMetaArgs(
                    name=f"clipforge-{component}-ingress",
                    namespace=args.namespace,
                    labels=labels(COMPONENT),
                ),
                spec=k8s.networking.v1.NetworkPolicySpecArgs(
                    pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=selector(component)),
                    policy_types=["Ingress"],
                    ingress=[
                        k8s.networking.v1.NetworkPolicyIngressRuleArgs(
                            from_=[
                                k8s.networking.v1.NetworkPolicyPeerArgs(
                                    pod_selector=k8s.meta.v1.LabelSelectorArgs(
                                        match_labels=selector(peer)
                                    )
                                )
                                for peer in peers
                            ]
                        )
                    ]
                    if peers
                    else [],
                ),
                opts=child,
            )
        self.register_outputs({})
