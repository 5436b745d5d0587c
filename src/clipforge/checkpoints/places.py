"""Where checkpoints are kept: one seam for a local run directory and a run store's fsspec URL.

`CheckpointStorage` is what the start of a run, the checkpointer and the uploader need of a
place holding checkpoints (torchtitan's checkpointer has the same seam): `LocalStorage` over a
directory, `FsspecStorage` over any fsspec filesystem (s3://, gs://, a local path). The functions
below it (tags, the marker, whether a checkpoint is whole, setting one aside) are written once
over the seam, so the disk and the store are held to the same proof.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import time
from pathlib import Path
from typing import Protocol

from clipforge.checkpoints.layout import (
    CHECKPOINT_MANIFEST,
    LATEST,
    content_problem,
    damaged_name,
    marker_text,
    parse_manifest,
    size_problem,
    step_of,
    tag_step,
)
from clipforge.fsutil import join_inside, sha256_file

_HASH_CHUNK_BYTES = 8 * 2**20


class CheckpointStorage(Protocol):
    where: str  # the directory or URL of the checkpoints, for messages

    def names(self) -> list[str]:
        """What is directly in the checkpoints directory (none when it does not exist)."""

    def read(self, relative: str) -> bytes | None:
        """A file's bytes; None when there is no such file."""

    def write(self, relative: str, data: bytes) -> None: ...

    def get(self, relative: str, local: Path) -> None:
        """Copy a file to `local` (FileNotFoundError when there is no such file)."""

    def sizes(self, name: str) -> dict[str, int]:
        """Every file under `name`, relative to it, with its size in bytes."""

    def sha256(self, relative: str) -> str:
        """A file's sha256, read where it is kept (no copy of it is made)."""

    def exists(self, name: str) -> bool: ...

    def move(self, name: str, new_name: str) -> None: ...

    def remove(self, name: str) -> None: ...


class LocalStorage:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.where = str(self.directory)

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []

    def read(self, relative: str) -> bytes | None:
        try:
            return (self.directory / relative).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except PermissionError:  # a teammate's file: said, never taken for a missing one
            from clipforge.checkpoints.access import denied

            raise denied(self.directory / relative, "read") from None

    def write(self, relative: str, data: bytes) -> None:
        from clipforge.fsutil import atomic_write_bytes

        atomic_write_bytes(self.directory / relative, data)

    def get(self, relative: str, local: Path) -> None:
        shutil.copyfile(self.directory / relative, local)

    def sha256(self, relative: str) -> str:
        return sha256_file(self.directory / relative)

    def sizes(self, name: str) -> dict[str, int]:
        base = self.directory / name
        return {str(p.relative_to(base)): p.stat().st_size for p in base.rglob("*") if p.is_file()}

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.directory / name)

    def move(self, name: str, new_name: str) -> None:
        (self.directory / name).rename(self.directory / new_name)

    def remove(self, name: str) -> None:
        path = self.directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


class FsspecStorage:
    """Checkpoints under `directory` of an fsspec filesystem; `url`: the same place, for
    messages. Object stores have no folders and no rename: a move is a copy, file by file (a
    recursive mv of a prefix fails on some stores once it is copied), then a removal."""

    def __init__(self, fs, directory: str, url: str):
        self.fs = fs
        self.directory = directory.rstrip("/")
        self.where = url.rstrip("/")

    def _path(self, relative: str) -> str:
        return posixpath.join(self.directory, relative)

    def names(self) -> list[str]:
        self.fs.invalidate_cache(self.directory)
        try:
            found = self.fs.ls(self.directory, detail=False)
        except FileNotFoundError:
            return []
        return sorted({posixpath.basename(p.rstrip("/")) for p in found})

    def read(self, relative: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(relative))
        except FileNotFoundError:
            return None

    def write(self, relative: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(relative), data)

    def get(self, relative: str, local: Path) -> None:
        self.fs.get_file(self._path(relative), str(local))

    def sha256(self, relative: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open(self._path(relative), "rb") as f:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
        return digest.hexdigest()

    def sizes(self, name: str) -> dict[str, int]:
        base = self._path(name)
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {
            posixpath.relpath(path, base): int(info.get("size") or 0)
            for path, info in found.items()
            if info.get("type", "file") == "file" and path.rstrip("/") != base  # a single object
        }

    def exists(self, name: str) -> bool:
        return bool(self.sizes(name)) or self.read(name) is not None

    def move(self, name: str, new_name: str) -> None:
        files = self.sizes(name)
        if not files:  # a single object (a marker)
            self.fs.copy(self._path(name), self._path(new_name))
            self.fs.rm_file(self._path(name))
            return
        for relative in sorted(files):
            self.fs.copy(self._path(f"{name}/{relative}"), self._path(f"{new_name}/{relative}"))
        self.fs.rm(self._path(name), recursive=True)

    def remove(self, name: str) -> None:
        try:
            self.fs.rm(self._path(name), recursive=True)
        except FileNotFoundError:
            pass


# -- over either -------------------------------------------------------------------------------
def tags(storage: CheckpointStorage) -> list[str]:
    """The checkpoint folders, oldest step first (set-aside and staging names left out)."""
    return sorted((n for n in storage.names() if tag_step(n) is not None), key=step_of)


def marker(storage: CheckpointStorage) -> str | None:
    """What `latest` holds, as text (garbage included); None without one."""
    data = storage.read(LATEST)
    return None if data is None else data.decode("utf-8", "replace")


def publish(storage: CheckpointStorage, tag: str) -> None:
    storage.write(LATEST, marker_text(tag).encode())


def has_manifest(storage: CheckpointStorage, tag: str) -> bool:
    return storage.read(f"{tag}/{CHECKPOINT_MANIFEST}") is not None


def manifest(storage: CheckpointStorage, tag: str) -> dict | None:
    data = storage.read(f"{tag}/{CHECKPOINT_MANIFEST}")
    return None if data is None else parse_manifest(data)


def fetch(storage: CheckpointStorage, tag: str, into: Path) -> None:
    """The files the manifest of `tag` lists there, and the manifest, into `into` (verified by
    the caller: clipforge.checkpoints.manifest.problem)."""
    found = manifest(storage, tag)
    if found is None:
        raise FileNotFoundError(f"{storage.where}/{tag}/{CHECKPOINT_MANIFEST}")
    source = f"{storage.where}/{tag}/{CHECKPOINT_MANIFEST}"  # whoever writes it names the files
    picks = [(n, join_inside(into, n, source)) for n in [*found["files"], CHECKPOINT_MANIFEST]]
    for name, local in picks:
        local.parent.mkdir(parents=True, exist_ok=True)
        storage.get(f"{tag}/{name}", local)


def not_whole(storage: CheckpointStorage, tag: str) -> str | None:
    """Why checkpoint `tag` is not whole there (no readable manifest, a file missing or of
    another size), in a few words; None when it is. The sha256 of each file is checked only
    where it is read (clipforge.checkpoints.manifest.problem)."""
    found = manifest(storage, tag)
    if found is None:
        if not storage.exists(tag):
            return "its folder is missing"
        return f"it has no readable {CHECKPOINT_MANIFEST}"
    sizes = storage.sizes(tag)
    sizes.pop(CHECKPOINT_MANIFEST, None)
    return size_problem(found, sizes)


def not_intact(storage: CheckpointStorage, tag: str) -> str | None:
    """Why checkpoint `tag` there is not what its manifest says, to the byte: not whole
    (`not_whole`), or a file whose sha256 differs; None when it is intact. Reads every file:
    for the guards that decide whether a copy elsewhere may go (`fab clean`, `make down`)."""
    problem = not_whole(storage, tag)
    if problem is not None:
        return problem
    found = manifest(storage, tag)
    assert found is not None  # not_whole found it
    return content_problem(found, lambda name: storage.sha256(f"{tag}/{name}"))


def set_aside(storage: CheckpointStorage, name: str) -> str:
    """Rename a damaged checkpoint (or marker) out of the way, kept for inspection; where it
    now is."""
    taken, now, attempt = set(storage.names()), time.time(), 0
    while damaged_name(name, now, attempt) in taken:
        attempt += 1
    new_name = damaged_name(name, now, attempt)
    storage.move(name, new_name)
    return f"{storage.where}/{new_name}"
