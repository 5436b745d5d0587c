"""clipforge infrastructure: GPU workers, retained storage and TensorBoard on a Kubernetes cluster.

Run by the Pulumi CLI through `make up` / `make down` / `make preview` (see infra/README.md). Config
is read here and only here; defaults live in Pulumi.yaml.
"""

import pulumi
import pulumi_kubernetes as k8s

from clipforge_infra.components.network_policies import NetworkPolicies, NetworkPoliciesArgs
from clipforge_infra.components.secrets import SecretsArgs, StackSecrets
from clipforge_infra.components.tensorboard import TensorBoard, TensorBoardArgs
from clipforge_infra.components.volumes import RetainedStorage, StorageArgs
from clipforge_infra.components.workers import GpuWorkers, WorkersArgs
from clipforge_infra.contract import PROJECT
from clipforge_infra.settings import StackConfigError, parse_settings, read_config
from clipforge_infra.stack_outputs import describe_stack

values = read_config(pulumi.Config())
secret_keys = {key for key in values if pulumi.runtime.is_config_secret(f"{PROJECT}:{key}")}
try:
    settings = parse_settings(values, secret_keys)
except StackConfigError as error:
    # RunError: reported as a plain message, without a Python traceback.
    raise pulumi.RunError(str(error)) from None

# An explicit provider pins the cluster: a stack never follows whatever context kubectl points at.
# An empty kubeContext means the kubeconfig's current-context, resolved by the provider.
provider = k8s.Provider("cluster", context=settings.kube_context if settings.kube_context else None)
on_cluster = pulumi.ResourceOptions(providers={"kubernetes": provider})

storage = RetainedStorage(
    "storage", StorageArgs(namespace=settings.namespace, storage=settings.storage), on_cluster
)
secrets = StackSecrets(
    "secrets",
    SecretsArgs(
        namespace=storage.namespace,
        ssh_authorized_keys=pulumi.Output.secret(settings.secrets.ssh_authorized_keys),
        alert_webhooks=pulumi.Output.secret(settings.secrets.alert_webhooks),
        registry_auth=pulumi.Output.secret(settings.secrets.registry_auth)
        if settings.secrets.registry_auth
        else None,
    ),
    on_cluster,
)
# `make down` sets released=true: the GPU workers and TensorBoard go, storage and secrets stay.
# runMode jobs: no workers at all; each `fab train` is a Job of its own (docs/launcher.md).
if settings.has_workers:
    GpuWorkers(
        "workers",
        WorkersArgs(
            namespace=storage.namespace,
            image=settings.image,
            workers=settings.workers,
            ssh_secret_name=secrets.ssh_secret_name,
            alerts_secret_name=secrets.alerts_secret_name,
            pull_secret_name=secrets.pull_secret_name,
        ),
        pulumi.ResourceOptions.merge(
            on_cluster, pulumi.ResourceOptions(depends_on=list(storage.claims.values()))
        ),
    )
if not settings.released:
    TensorBoard(
        "tensorboard",
        TensorBoardArgs(
            namespace=storage.namespace,
            image=settings.image,
            tensorboard=settings.tensorboard,
            tolerations=settings.workers.tolerations,
            pull_secret_name=secrets.pull_secret_name,
        ),
        pulumi.ResourceOptions.merge(
            on_cluster, pulumi.ResourceOptions(depends_on=[storage.claims["logs"]])
        ),
    )

# Who may connect to the stack's pods: each kind only from its own kind, TensorBoard from none.
NetworkPolicies("network", NetworkPoliciesArgs(namespace=storage.namespace), on_cluster)

for name, value in describe_stack(settings, storage.namespace, secrets.host_public_key).items():
    pulumi.export(name, value)
