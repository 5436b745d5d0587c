"""A checkpoint's manifest: the size and sha256 of each of its files, in its `manifest.json`.

Written after the checkpoint's files and before the `latest` marker names it, so a checkpoint
with a manifest was complete when saved; `problem` then tells whether it still is (a truncated or
emptied file, a missing one, changed bytes). The run store compares manifests to know whether it
holds a checkpoint, and uploads a checkpoint's manifest after its other files.

Standard library only: `make down`'s guard reads manifests on the workers with a bare python3.
"""

from __future__ import annotations

import json
from pathlib import Path

from clipforge.checkpoints.layout import (
    CHECKPOINT_MANIFEST,
    content_problem,
    parse_manifest,
    size_problem,
)
from clipforge.fsutil import atomic_write_text, sha256_file


def checkpoint_files(directory: Path) -> list[str]:
    """The files of a checkpoint, relative to it, in a fixed order (the manifest left out)."""
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != CHECKPOINT_MANIFEST
    )


def write_manifest(directory: Path) -> dict:
    files = {
        name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
        for name in checkpoint_files(directory)
    }
    manifest = {"tag": directory.name, "files": files}
    atomic_write_text(
        directory / CHECKPOINT_MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    )
    return manifest


def read_manifest(directory: Path) -> dict | None:
    """The manifest, or None when there is none or it is not one."""
    try:
        return parse_manifest((directory / CHECKPOINT_MANIFEST).read_bytes())
    except OSError:
        return None


def problem(directory: Path) -> str | None:
    """What is wrong with the checkpoint in `directory`, in a few words; None when every file its
    manifest lists is there with its size and sha256. Sizes are checked first: a truncated file
    is found without reading the others."""
    if not directory.is_dir():
        return "its folder is missing"
    manifest = read_manifest(directory)
    if manifest is None:
        return f"it has no readable {CHECKPOINT_MANIFEST} (a save cut short)"
    sizes = {name: (directory / name).stat().st_size for name in checkpoint_files(directory)}
    found = size_problem(manifest, sizes)
    if found:
        return found
    return content_problem(manifest, lambda name: sha256_file(directory / name))
