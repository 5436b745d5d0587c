"""The training image reference, from docker/image.env (its single source) and an optional registry."""

from __future__ import annotations

from pathlib import Path


class ImageEnvError(ValueError):
    """docker/image.env is missing a key or malformed."""


def read_image_env(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and # comments ignored (the same file the Makefile includes)."""
    if not path.is_file():
        raise ImageEnvError(f"{path} not found: it names the training image (IMAGE_REPOSITORY, IMAGE_TAG)")
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ImageEnvError(f"{path}:{number}: expected KEY=VALUE")
        values[key.strip()] = value.strip()
    return values


def image_reference(path: Path, registry: str) -> str:
    """``[registry/]IMAGE_REPOSITORY:IMAGE_TAG``; ``registry`` may be empty."""
    values = read_image_env(path)
    for key in ("IMAGE_REPOSITORY", "IMAGE_TAG"):
        if not values.get(key):
            raise ImageEnvError(f"{path}: {key} is missing or empty")
    prefix = f"{registry.rstrip('/')}/" if registry else ""
    return f"{prefix}{values['IMAGE_REPOSITORY']}:{values['IMAGE_TAG']}"
