"""One training run in the run store (`storage.remote`), through fsspec.

One training run in the run store (`storage.remote`), through fsspec: any URL it knows (s3://,
gs://, oss://, az://...) or a local path.

  <remote>/<run id>/checkpoints/step-NNNNNNNN/   a checkpoint's files; its manifest.json last
  <remote>/<run id>/checkpoints/latest           the newest complete checkpoint, written last
  <remote>/<run id>/checkpoints/damaged-...      checkpoints found damaged, set aside
  <remote>/<run id>/lease.json                   the trainer writing the run, and its heartbeat
  <remote>/<run id>/logs/<label>/                TensorBoard events
  <remote>/<run id>/metrics/                     train.tsv, val.tsv, train.json, train.info.json
  <remote>/<run id>/models/clip/                 the exported model, at the end
  <remote>/<run id>/record.json, status.json     the run's record; where it stands, and when
  <remote>/launches/<launch id>.json             a `fab train` launch: its run.json + run id

A checkpoint's files go up first, its manifest after them and the marker last, so a reader that
follows the marker, or takes only checkpoints with a manifest, never sees a torn one (a process
killed mid-upload). Before a checkpoint is uploaded again (a rerun of the same steps, a copy
found not whole), its old manifest is removed first, for the same reason. A checkpoint counts as
held only when it is whole: its manifest there and every file it lists with its size
(clipforge.checkpoints.places.not_whole); the marker is a hint. What is downloaded is verified
against its manifest before it is used. The names are clipforge.checkpoints.layout's. Whoever can
write the store can make it list any name, so every name that becomes a local path goes through
clipforge.fsutil.join_inside first: `logs/../../.bashrc` is refused, and nothing is downloaded.

fsspec and the protocol's library (s3fs for s3://) are imported when a store is opened, not
before: a run without a store never needs them.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable, Mapping
from pathlib import Path

from clipforge.checkpoints import places
from clipforge.checkpoints.layout import (
    CHECKPOINT_MANIFEST,
    STORE_CHECKPOINTS,
    step_of,
    tag_step,
)
from clipforge.errors import UserError
from clipforge.fsutil import join_inside
from clipforge.util import exception_summary

LAUNCHES = "launches"
# Set by `fab train` for the train stage: the launch's run.json, which the stage copies to
# <remote>/launches/<launch id>.json, so that the launch can be found from its id alone.
RUN_RECORD_ENV = "CLIPFORGE_RUN_RECORD"


class StoreError(UserError, RuntimeError):
    """The store cannot be used as configured (no library for its protocol); the message says
    what to install."""


def open_filesystem(remote: str):
    """(fsspec filesystem, root path in it) of a store URL or local path."""
    try:
        import fsspec
    except ImportError:
        raise StoreError(
            "storage.remote needs fsspec: pip install 'clipforge[store]' (fsspec + s3fs)"
        ) from None
    try:
        fs, root = fsspec.core.url_to_fs(remote)
    except (ImportError, ValueError) as exc:  # fsspec names the package a protocol needs
        raise StoreError(f"storage.remote {remote}: {exc}") from None
    except OSError as exc:  # a protocol that connects when opened (ftp://, sftp://): no server
        raise StoreError(
            f"storage.remote {remote}: cannot be opened ({exception_summary(exc, 200)})"
        ) from None
    if hasattr(fs, "auto_mkdir"):  # a local path: folders come with files, as on object stores
        fs.auto_mkdir = True
    return fs, root.rstrip("/")


class RunStore:
    """`<remote>/<run id>/` of one training run."""

    def __init__(self, remote: str, run_id: str, filesystem=None):
        self.remote = remote.rstrip("/")
        self.run_id = run_id
        self.fs, root = filesystem or open_filesystem(remote)
        self.root = posixpath.join(root, run_id)
        self.url = f"{self.remote}/{run_id}"
        self.checkpoints = places.FsspecStorage(
            self.fs, self.path(STORE_CHECKPOINTS), f"{self.url}/{STORE_CHECKPOINTS}"
        )

    def path(self, relative: str) -> str:
        return posixpath.join(self.root, relative)

    # -- checkpoints -------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        """Steps of the checkpoints the store holds whole (its manifest, which went up after its
        files, and every file it lists with its size), oldest first."""
        return [
            step_of(tag)
            for tag in places.tags(self.checkpoints)
            if places.has_manifest(self.checkpoints, tag)
            and places.not_whole(self.checkpoints, tag) is None
        ]

    def upload_checkpoint(
        self, directory: Path, after_first_file: Callable[[], None] = lambda: None
    ) -> None:
        """Files first, the manifest last (any manifest left from an earlier upload of this tag
        removed before); not the marker: `publish` does that. `after_first_file`: a fault hook."""
        target = self.path(f"{STORE_CHECKPOINTS}/{directory.name}")
        if self.fs.exists(f"{target}/{CHECKPOINT_MANIFEST}"):
            self.fs.rm_file(f"{target}/{CHECKPOINT_MANIFEST}")
        names = [str(p.relative_to(directory)) for p in sorted(directory.rglob("*")) if p.is_file()]
        names.sort(key=lambda name: name == CHECKPOINT_MANIFEST)  # stable: the manifest goes last
        for index, name in enumerate(names):
            self.fs.put_file(str(directory / name), f"{target}/{name}")
            if index == 0:
                after_first_file()

    def publish(self, tag: str) -> None:
        places.publish(self.checkpoints, tag)

    def prune(self, keep: int) -> list[str]:
        """Keep the `keep` newest complete checkpoints; remove older checkpoint folders (complete
        or torn). Returns the removed tags."""
        kept = self.complete_steps()[-keep:]
        if not kept:
            return []
        removed = [tag for tag in places.tags(self.checkpoints) if step_of(tag) < kept[0]]
        for tag in removed:
            self.checkpoints.remove(tag)
        return removed

    # -- other files -------------------------------------------------------------------------
    def upload_file(self, local: Path, relative: str) -> None:
        self.fs.put_file(str(local), self.path(relative))

    def download_file(self, relative: str, local: Path) -> bool:
        """False when the store has no such file."""
        try:
            self.fs.get_file(self.path(relative), str(local))
        except FileNotFoundError:
            return False
        return True

    def download_trees(self, trees: Mapping[str, Path], keep_existing: bool = False) -> int:
        """The files under each folder of the store in `trees` (relative: local folder), as named
        there, into its local folder (`keep_existing`: but those it holds). Every name of every
        folder is checked before any file is written. Returns how many files the folders hold."""
        picks = {
            relative: [
                (name, join_inside(into, name, f"the run store {self.url}/{relative}"))
                for name in self.files(relative)
            ]
            for relative, into in trees.items()
        }
        for relative, files in picks.items():
            self._download(relative, [f for f in files if not (keep_existing and f[1].exists())])
        return sum(len(files) for files in picks.values())

    def _download(self, relative: str, picks: list[tuple[str, Path]]) -> None:
        for name, local in picks:
            local.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(self.path(f"{relative}/{name}"), str(local))

    def files(self, relative: str) -> list[str]:
        """Files under `relative`, as paths relative to it: each key as the store lists it, not
        normalized (`a/../b` stays what it is, for join_inside to judge)."""
        base = self.path(relative)
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        prefix = base.rstrip("/") + "/"
        return sorted(
            p[len(prefix) :] if p.startswith(prefix) else posixpath.relpath(p, base) for p in found
        )

    def write_json(self, relative: str, value: dict) -> None:
        self.fs.pipe_file(self.path(relative), (json.dumps(value, indent=2) + "\n").encode())

    def read_json(self, relative: str) -> dict | None:
        return _read_json(self.fs, self.path(relative))

    def write_launch(self, launch_id: str, record: dict) -> None:
        """`fab train`'s record of a launch, under the store's root, with this run's id."""
        path = posixpath.join(posixpath.dirname(self.root), LAUNCHES, f"{launch_id}.json")
        record = {**record, "training_run": self.run_id, "store": self.remote}
        self.fs.pipe_file(path, (json.dumps(record, indent=2) + "\n").encode())


def missing_from_store(remote: str, run_id: str, tag: str) -> str | None:
    """None when the store holds checkpoint `tag` of training run `run_id` intact (its manifest
    went up after its files, and every file it lists is there with its size and sha256, read from
    the store: a copy elsewhere may go on this answer); else why not, as a predicate ("is not in
    the run store ... yet", "is not whole in the run store ...")."""
    if tag_step(tag) is None:
        return f"is not in the run store {remote} yet"
    try:
        store = RunStore(remote, run_id)
        if places.has_manifest(store.checkpoints, tag):
            problem = places.not_intact(store.checkpoints, tag)
            if problem is None:
                return None
            return f"is not whole in the run store {remote} ({problem})"
    except Exception as exc:  # any library's error: unreachable, no credentials, no bucket
        return f"cannot be looked for in the run store {remote} ({exception_summary(exc, 200)})"
    return f"is not in the run store {remote} yet"


def read_launch(remote: str, launch_id: str) -> dict | None:
    """What `write_launch` wrote for `launch_id`; None when the store has no such launch."""
    fs, root = open_filesystem(remote)
    return _read_json(fs, posixpath.join(root, LAUNCHES, f"{launch_id}.json"))


def _read_json(fs, path: str) -> dict | None:
    try:
        return json.loads(fs.cat_file(path))
    except (FileNotFoundError, ValueError):
        return None
