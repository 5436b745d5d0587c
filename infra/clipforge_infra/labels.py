"""Labels shared by every object of the stack, so that selectors and `kubectl get -l` agree."""

from __future__ import annotations

APP = "clipforge"


def labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "pulumi",
    }


def selector(component: str) -> dict[str, str]:
    """The immutable subset used in selectors (managed-by may change; these must not)."""
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}
