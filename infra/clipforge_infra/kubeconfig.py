"""Checks that a kubeconfig exists and holds the context a stack targets, before Pulumi is called.

Follows kubectl's rules: $KUBECONFIG is a list of files (os.pathsep-separated) merged in order, the
first current-context wins; without it, ~/.kube/config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from clipforge.errors import UserError
from clipforge.yamlfile import yaml_error_line


class KubeconfigError(UserError, RuntimeError):
    """No usable kubeconfig or context; the message says what to do."""


def kubeconfig_paths(environ: Mapping[str, str]) -> list[Path]:
    if environ.get("KUBECONFIG"):
        return [Path(part).expanduser() for part in environ["KUBECONFIG"].split(os.pathsep) if part]
    return [Path(environ.get("HOME", "~")).expanduser() / ".kube" / "config"]


def resolve_context(requested: str, environ: Mapping[str, str]) -> str:
    """The context the stack will use: ``requested``, or the current-context when it is empty."""
    paths = kubeconfig_paths(environ)
    existing = [path for path in paths if path.is_file()]
    if not existing:
        shown = os.pathsep.join(str(path) for path in paths)
        raise KubeconfigError(
            f"no kubeconfig at {shown}: get one for your GPU cluster (your cloud's "
            "`get-credentials` command or your admin) or point KUBECONFIG at it"
        )
    contexts: list[str] = []
    current = ""
    for path in existing:
        try:
            document = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise KubeconfigError(yaml_error_line(path, error)) from None
        if not isinstance(document, dict):
            raise KubeconfigError(f"{path}: not a kubeconfig (expected a YAML mapping)")
        contexts += [entry.get("name", "") for entry in document.get("contexts") or []]
        current = current or document.get("current-context") or ""
    context = requested if requested else current
    if not context:
        raise KubeconfigError(
            "the kubeconfig has no current-context and the stack sets no kubeContext: "
            "`pulumi -C infra config set kubeContext <context>`"
        )
    if context not in contexts:
        known = ", ".join(sorted(contexts)) or "none"
        raise KubeconfigError(
            f"context {context!r} is not in the kubeconfig ({known}); fix kubeContext in "
            "the stack file or add the context"
        )
    return context
