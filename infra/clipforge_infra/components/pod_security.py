"""The security settings every pod and container of the stack runs with, and its pull credentials.

Non-root (uid 1000, matching the image's user), no privilege escalation, no capabilities, the
runtime's default seccomp profile. sshd needs none of these: it listens on a port above 1024 and,
running as the only user it serves, never switches user.
"""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from ..contract import RUN_AS_GID, RUN_AS_UID


def pod_security_context() -> k8s.core.v1.PodSecurityContextArgs:
    return k8s.core.v1.PodSecurityContextArgs(
        run_as_non_root=True,
        run_as_user=RUN_AS_UID,
        run_as_group=RUN_AS_GID,
        fs_group=RUN_AS_GID,
        # Re-owning a dataset volume of millions of files on every pod start would take minutes;
        # only fix ownership when the volume root does not match already.
        fs_group_change_policy="OnRootMismatch",
        seccomp_profile=k8s.core.v1.SeccompProfileArgs(type="RuntimeDefault"),
    )


def container_security_context() -> k8s.core.v1.SecurityContextArgs:
    return k8s.core.v1.SecurityContextArgs(
        run_as_non_root=True,
        privileged=False,
        allow_privilege_escalation=False,
        capabilities=k8s.core.v1.CapabilitiesArgs(drop=["ALL"]),
    )


def pull_secrets(
    secret_name: pulumi.Input[str] | None,
) -> list[k8s.core.v1.LocalObjectReferenceArgs] | None:
    """imagePullSecrets for a private registry, or None for a public image."""
    if secret_name is None:
        return None
    return [k8s.core.v1.LocalObjectReferenceArgs(name=secret_name)]
