"""webdataset tar shards: writing them, and reading samples back by position.

Writing goes through the `webdataset` library so the shards are what every webdataset tool
expects (`<key>.jpg` + `<key>.txt` per sample). Reading for training uses the tar headers
directly: a sample is addressed by (shard, index), which makes the data order a pure function
of the step and lets a resumed run seek straight to its position.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from clipforge.fsutil import sha256_file


@dataclass(frozen=True)
class ShardInfo:
    name: str  # relative to the data root, e.g. "train/shard-000000.tar"
    count: int
    sha256: str


class ShardWriter:
    """Writes samples one at a time into root/split/shard-NNNNNN.tar, samples_per_shard each, so
    several splits can be filled from one pass over a stream too large to hold in memory."""

    def __init__(self, root: Path, split: str, samples_per_shard: int):
        import webdataset as wds  # imports torch (~3 s): only once params have been validated

        self._tar_writer = wds.TarWriter
        self.root = root
        self.split = split
        self.samples_per_shard = samples_per_shard
        self.shards: list[ShardInfo] = []
        self._writer: wds.TarWriter | None = None
        self._name = ""
        self._count = 0
        (root / split).mkdir(parents=True, exist_ok=True)

    def write(self, key: str, jpeg: bytes, caption: str) -> None:
        if self._writer is None or self._count == self.samples_per_shard:
            self._finish_shard()
            self._name, self._count = f"{self.split}/shard-{len(self.shards):06d}.tar", 0
            # a fixed mtime makes the shards byte-for-byte reproducible, so DVC sees no change
            self._writer = self._tar_writer(str(self.root / self._name), mtime=0)
        self._writer.write({"__key__": key, "jpg": jpeg, "txt": caption})
        self._count += 1

    def close(self) -> list[ShardInfo]:
        self._finish_shard()
        return self.shards

    def _finish_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self.shards.append(
                ShardInfo(self._name, self._count, sha256_file(self.root / self._name))
            )


def write_shards(
    pairs: Iterable[tuple[str, bytes, str]], root: Path, split: str, samples_per_shard: int
) -> list[ShardInfo]:
    """Write (key, jpeg bytes, caption) triples into root/split/shard-NNNNNN.tar files."""
    writer = ShardWriter(root, split, samples_per_shard)
    for key, jpeg, caption in pairs:
        writer.write(key, jpeg, caption)
    return writer.close()


@dataclass(frozen=True)
class Member:
    offset: int
    size: int

    def read(self, f: BinaryIO) -> bytes:
        f.seek(self.offset)
        return f.read(self.size)


def index_shard(path: Path) -> dict[str, dict[str, Member]]:
    """key -> {extension: where its bytes are}, in file order, from the tar headers only."""
    samples: dict[str, dict[str, Member]] = {}
    with tarfile.open(path, "r:") as tar:
        for info in tar:
            if info.isfile():
                key, _, ext = info.name.partition(".")
                samples.setdefault(key, {})[ext] = Member(info.offset_data, info.size)
    return samples


class ShardReader:
    """Random access to samples of local shards: tar indexes are built once per shard and a few
    files are kept open (one reader per loader worker)."""

    def __init__(self, paths: list[Path], max_open_files: int = 16):
        self.paths = paths
        self.max_open_files = max_open_files
        self._indexes: dict[int, list[dict[str, Member]]] = {}  # per shard, samples by position
        self._files: dict[int, BinaryIO] = {}

    def read(self, shard: int, index: int) -> dict[str, bytes]:
        if shard not in self._indexes:
            self._indexes[shard] = list(index_shard(self.paths[shard]).values())
        f = self._file(shard)
        return {ext: member.read(f) for ext, member in self._indexes[shard][index].items()}

    def _file(self, shard: int) -> BinaryIO:
        if shard not in self._files:
            if len(self._files) >= self.max_open_files:
                oldest = next(iter(self._files))
                self._files.pop(oldest).close()
            self._files[shard] = open(self.paths[shard], "rb")
        return self._files[shard]
