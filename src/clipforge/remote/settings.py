"""Launcher settings: Fabric config under `clipforge` (fabric.yaml, or FABRIC_CLIPFORGE_* env).

Their defaults live in one place, fabfile.py's collection config; this only reads and checks them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from clipforge.image_env import ImageEnvError, parse_image_env
from clipforge.remote.errors import RemoteError


@dataclass(frozen=True, kw_only=True)
class Settings:
    remote_root: Optional[str]  # None: the stack's checkpoints volume, else ~/clipforge-runs
    python: str  # on the host: runs the supervisor (and the stage with --runtime host)
    stack_outputs: Path
    min_free_gb: float
    backoff_seconds: float
    backoff_max_seconds: float
    stop_timeout_seconds: float
    shm_size: str
    registry: Optional[str]

    def __post_init__(self) -> None:
        if self.min_free_gb < 0:
            raise RemoteError(f"clipforge.min_free_gb: must be >= 0, got {self.min_free_gb}")
        if not 0 <= self.backoff_seconds <= self.backoff_max_seconds:
            raise RemoteError("clipforge.backoff_seconds: must be between 0 and "
                              f"clipforge.backoff_max_seconds ({self.backoff_max_seconds})")
        if self.stop_timeout_seconds <= 0:
            raise RemoteError("clipforge.stop_timeout_seconds: must be > 0")


def settings_from(config) -> Settings:
    """Read the `clipforge` section of a Fabric/Invoke config. Values from FABRIC_* environment
    variables arrive as strings, hence the conversions."""
    section = config.get("clipforge")
    if section is None:
        raise RemoteError("Fabric config has no `clipforge` section: run fab from the project root "
                          "(its fabfile.py defines it)")

    def number(key: str) -> float:
        try:
            return float(section[key])
        except (TypeError, ValueError):
            raise RemoteError(f"clipforge.{key}: a number, got {section[key]!r}") from None

    def optional(key: str) -> Optional[str]:
        value = section[key]
        return None if value in (None, "") else str(value)

    registry = optional("registry")
    return Settings(
        remote_root=optional("remote_root"),
        python=str(section["python"]),
        stack_outputs=Path(str(section["stack_outputs"])),
        min_free_gb=number("min_free_gb"),
        backoff_seconds=number("backoff_seconds"),
        backoff_max_seconds=number("backoff_max_seconds"),
        stop_timeout_seconds=number("stop_timeout_seconds"),
        shm_size=str(section["shm_size"]),
        registry=registry if registry is not None else os.environ.get("REGISTRY") or None,
    )


def image_reference(image_env: Optional[str], registry: Optional[str]) -> str:
    """[$REGISTRY/]IMAGE_REPOSITORY:IMAGE_TAG from docker/image.env (the one place naming it)."""
    if image_env is None:
        raise RemoteError("the commit has no docker/image.env; it names the training image")
    try:
        return parse_image_env(image_env).reference(registry)
    except ImageEnvError as exc:
        raise RemoteError(str(exc)) from None
