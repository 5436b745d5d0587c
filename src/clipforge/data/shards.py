"""webdataset tar shards: writing them, and reading samples back by position.

Shards used in place (data.in_place) are read here too, by the locations the data stage
indexed, after a check that each is still what the manifest recorded (its identity).

Writing goes through the `webdataset` library so the shards are what every webdataset tool
expects (`<key>.jpg` + `<key>.txt` per sample, and `<key>.tok`, the caption's token ids, with
data.pretokenize_model). Reading for training uses the tar headers
directly: a sample is addressed by (shard, index), which makes the data order a pure function
of the step and lets a resumed run seek straight to its position.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import os
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from clipforge.errors import StageError
from clipforge.fsutil import sha256_file

SAMPLED_HASH_BYTES = 1 << 16  # identity: sha256 of the first, middle and last 64 KiB


@dataclass(frozen=True)
class ShardInfo:
    name: str  # relative to the data root, e.g. "train/shard-000000.tar"
    count: int
    sha256: str


# -- token ids stored with the samples (data.pretokenize_model) ---------------------------------

TOKENS_MEMBER = "tok"  # <key>.tok: the caption's ids at the context length, little-endian
INDEX_TOKENS = "tokens"  # in place: the index file's array of stored ids, [n, context length]
TOKENIZE_BATCH = 256  # captions tokenised per call: a fast HF tokenizer's cost is mostly per call


@dataclass(frozen=True)
class TokenFormat:
    """How a sample's token ids are stored: exactly the tokenizer's output row (context_length
    ids, its truncation and padding included), as `dtype` (uint16 when every id fits, which a
    tar member holds in one 512-byte block up to 256 ids; int32 otherwise)."""

    dtype: str  # numpy's name: "<u2" or "<i4"
    context_length: int

    @classmethod
    def for_vocabulary(cls, max_id: int, context_length: int) -> TokenFormat:
        return cls("<u2" if max_id < 2**16 else "<i4", context_length)

    def encode(self, ids: np.ndarray) -> list[bytes]:
        """Rows of ids [n, context_length] -> each row's stored bytes."""
        ids = np.asarray(ids)
        limits = np.iinfo(np.dtype(self.dtype))
        if ids.ndim != 2 or ids.shape[1] != self.context_length:
            raise ValueError(f"token ids of shape {ids.shape}, not [n, {self.context_length}]")
        if ids.size and (ids.min() < limits.min or ids.max() > limits.max):
            raise ValueError(f"token ids {ids.min()}..{ids.max()} do not fit {self.dtype}")
        return [row.tobytes() for row in ids.astype(self.dtype)]

    def decode(self, stored: list[bytes]) -> np.ndarray:
        """Stored rows -> int64 ids [n, context_length], as the tokenizer returns them."""
        flat = np.frombuffer(b"".join(stored), dtype=self.dtype)
        return flat.reshape(len(stored), self.context_length).astype(np.int64)

    def to_dict(self) -> dict:
        return {"member": TOKENS_MEMBER, "dtype": self.dtype, "context_length": self.context_length}


Tokenize = Callable[[list[str]], list[bytes]]  # captions -> each one's stored token ids


@dataclass(frozen=True)
class CaptionTokenizer:
    """A Tokenize: a tokenizer's ids in a TokenFormat. Picklable, for the in-place scan's
    worker processes."""

    tokenizer: Callable
    format: TokenFormat

    def __call__(self, captions: list[str]) -> list[bytes]:
        return self.format.encode(np.asarray(self.tokenizer(captions)))


class ShardWriter:
    """Writes samples one at a time into root/split/shard-NNNNNN.tar, samples_per_shard each, so
    several splits can be filled from one pass over a stream too large to hold in memory.
    `tokenize`: each sample also gets its caption's token ids (TOKENS_MEMBER), made
    TOKENIZE_BATCH captions at a time."""

    def __init__(
        self, root: Path, split: str, samples_per_shard: int, tokenize: Tokenize | None = None
    ):
        import webdataset as wds  # imports torch (~3 s): only once params have been validated

        self._tar_writer = wds.TarWriter
        self.root = root
        self.split = split
        self.samples_per_shard = samples_per_shard
        self.tokenize = tokenize
        self.shards: list[ShardInfo] = []
        self._writer: wds.TarWriter | None = None
        self._name = ""
        self._count = 0
        self._pending: list[tuple[str, bytes, str]] = []
        (root / split).mkdir(parents=True, exist_ok=True)

    def write(self, key: str, jpeg: bytes, caption: str) -> None:
        if self.tokenize is None:
            self._write({"__key__": key, "jpg": jpeg, "txt": caption})
            return
        self._pending.append((key, jpeg, caption))
        if len(self._pending) == TOKENIZE_BATCH:
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and self.tokenize is not None:
            tokens = self.tokenize([caption for _, _, caption in pending])
            for (key, jpeg, caption), ids in zip(pending, tokens, strict=True):
                self._write({"__key__": key, "jpg": jpeg, "txt": caption, TOKENS_MEMBER: ids})

    def _write(self, sample: dict) -> None:
        if self._writer is None or self._count == self.samples_per_shard:
            self._finish_shard()
            self._name, self._count = f"{self.split}/shard-{len(self.shards):06d}.tar", 0
            # a fixed mtime makes the shards byte-for-byte reproducible, so DVC sees no change
            self._writer = self._tar_writer(str(self.root / self._name), mtime=0)
        self._writer.write(sample)
        self._count += 1

    def close(self) -> list[ShardInfo]:
        self._flush()
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
    pairs: Iterable[tuple[str, bytes, str]],
    root: Path,
    split: str,
    samples_per_shard: int,
    tokenize: Tokenize | None = None,
) -> list[ShardInfo]:
    """Write (key, jpeg bytes, caption) triples into root/split/shard-NNNNNN.tar files."""
    writer = ShardWriter(root, split, samples_per_shard, tokenize)
    for key, jpeg, caption in pairs:
        writer.write(key, jpeg, caption)
    return writer.close()


def rewrite_shard(root: Path, info: ShardInfo, dropped: set[int]) -> ShardInfo:
    """root/info.name again without the samples at positions `dropped` (the others keep their
    keys and order), written beside it and moved into place; its new ShardInfo."""
    import webdataset as wds

    path = root / info.name
    kept = [s for n, s in enumerate(index_shard(path).items()) if n not in dropped]
    partial = path.with_name(f".{path.name}.partial")
    with open(path, "rb") as f:
        writer = wds.TarWriter(str(partial), mtime=0)  # as ShardWriter: byte-for-byte reproducible
        for key, members in kept:
            writer.write({"__key__": key, **{ext: m.read(f) for ext, m in members.items()}})
        writer.close()
    os.replace(partial, path)
    return ShardInfo(info.name, len(kept), sha256_file(path))


@dataclass(frozen=True)
class Member:
    offset: int
    size: int

    def read(self, f: BinaryIO) -> bytes:
        f.seek(self.offset)
        return f.read(self.size)


# The most a PAX or GNU long-name header may hold (a name, a few attributes: bytes to kilobytes).
# tarfile reads one whole before the member it describes, so a compressed shard declaring a 1 GiB
# one would take 1 GiB of memory.
MAX_EXTENDED_HEADER_BYTES = 1 << 20
_EXTENDED_TYPES = frozenset(
    {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME}
    | {tarfile.GNUTYPE_LONGLINK}
)


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile's member, refusing an extended header over MAX_EXTENDED_HEADER_BYTES before it is
    read (tarfile.ReadError: the shard counts as damaged)."""

    def _proc_member(self, tarfile_):  # tarfile's own hook, called on every header read
        if self.type in _EXTENDED_TYPES and self.size > MAX_EXTENDED_HEADER_BYTES:
            raise tarfile.ReadError(
                f"a {self.size}-byte extended header at byte {self.offset} (at most "
                f"{MAX_EXTENDED_HEADER_BYTES})"
            )
        return super()._proc_member(tarfile_)


# A stream passes over a member it does not read by reading it, this much at a time.
_STREAM_BUFFER_BYTES = 1 << 20


def open_tar(fileobj: BinaryIO, mode: Literal["r:", "r|*"]) -> tarfile.TarFile:
    """tarfile.open on a file object (`r:` seekable, `r|*` a stream, gzip, bzip2, xz or plain),
    with extended headers bounded: every reader of shards opens them so."""
    if mode == "r:":
        return tarfile.open(fileobj=fileobj, mode=mode, tarinfo=_BoundedTarInfo)
    return tarfile.open(
        fileobj=_decompressed(fileobj),
        mode="r|",
        tarinfo=_BoundedTarInfo,
        bufsize=_STREAM_BUFFER_BYTES,
    )


def _decompressed(fileobj: BinaryIO) -> BinaryIO | io.BufferedIOBase:
    """A compressed shard (known by its first bytes) through its module's reader, which returns
    at most what is asked: tarfile's own decompression expands a whole chunk of compressed bytes
    at once and copies what is left of it on every read (52 s, 10 MB at a time, to pass over a
    1 GiB member of zeros that gzip holds in 1 MB). Anything else as it is."""
    start = fileobj.read(6)
    fileobj.seek(0)
    if start.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=fileobj, mode="rb")
    if start.startswith(b"BZh"):
        return bz2.BZ2File(fileobj)
    if start.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(fileobj)
    return fileobj


def index_shard(path: Path) -> dict[str, dict[str, Member]]:
    """key -> {extension: where its bytes are}, in file order, from the tar headers only."""
    samples: dict[str, dict[str, Member]] = {}
    with open(path, "rb") as f, open_tar(f, "r:") as tar:
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


# -- shards used in place (clipforge.data.inplace writes their index) --------------------------


class ShardChangedError(StageError):
    """A shard is not what the manifest recorded: its bytes are not where the index says."""


def shard_identity(url: str, sampled_hash: bool = False) -> dict:
    """Size and mtime (local) or etag/mtime (fsspec), and optionally a sampled sha256."""
    if "://" not in url:
        stat = os.stat(url)
        identity: dict = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    else:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
        fs.invalidate_cache(path)  # s3fs answers from its listing cache: a shard's old etag
        identity = _remote_identity(fs.info(path))
    if sampled_hash:
        identity["sampled_sha256"] = _sampled_sha256(url, identity["size"])
    return identity


def _sampled_sha256(url: str, size: int) -> str:
    digest = hashlib.sha256(str(size).encode())
    with open_shard(url) as f:
        for start in sorted({0, max(0, size // 2 - SAMPLED_HASH_BYTES // 2), size}):
            f.seek(max(0, min(start, size - SAMPLED_HASH_BYTES)))
            digest.update(f.read(SAMPLED_HASH_BYTES))
    return digest.hexdigest()


def _remote_identity(info: dict) -> dict:
    """Size, etag and mtime from an fsspec info entry (S3, GCS, HTTP... name them differently)."""
    identity: dict = {"size": int(info["size"])}
    for key in ("ETag", "etag", "e_tag"):
        if info.get(key):
            identity["etag"] = str(info[key]).strip('"')
            break
    for key in ("mtime", "LastModified", "last_modified", "updated"):
        if info.get(key) is not None:
            identity["mtime"] = str(info[key])
            break
    return identity


def changed(url: str, recorded: dict, now: dict | None = None) -> str | None:
    """What differs between a shard and its recorded identity (None: nothing); `now`: its
    identity when already known (a directory listing)."""
    if now is None:
        try:
            now = shard_identity(url)
        except FileNotFoundError:
            return "it is gone"
    for key in ("size", "mtime_ns", "etag", "mtime"):
        if key in recorded and now.get(key) != recorded[key]:
            return f"its {key} was {recorded[key]}, now {now.get(key)}"
    return None


def check_unchanged(shards: list[dict]) -> None:
    """ShardChangedError naming every shard (up to a few) that changed since the manifest."""
    problems = []
    listed = _listed_identities([s["url"] for s in shards if "://" in s["url"]])
    for shard in shards:
        url = shard["url"]
        if "://" in url and url not in listed:
            why: str | None = "it is gone"
        else:
            why = changed(url, shard["identity"], listed.get(url))
        if why:
            problems.append(f"{shard['url']}: {why}")
    if problems:
        shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
        raise ShardChangedError(
            "shards changed since the data stage indexed them (rerun it: dvc repro data):\n"
            + "\n".join(shown)
        )


def _listed_identities(urls: list[str]) -> dict[str, dict]:
    """Identities of remote shards from one listing per directory: 100k shards on S3 are ~100
    paginated LIST requests, not 100k HEAD requests."""
    import fsspec

    by_directory: dict[str, list[str]] = {}
    for url in urls:
        by_directory.setdefault(url.rsplit("/", 1)[0], []).append(url)
    found = {}
    for directory, members in by_directory.items():
        fs, path = fsspec.core.url_to_fs(directory)
        fs.invalidate_cache(path)  # a listing cached by this process shows the old etags
        infos = {fs.unstrip_protocol(i["name"]): i for i in fs.ls(path, detail=True) if "size" in i}
        for url in members:
            info = infos.get(url) or infos.get(fs.unstrip_protocol(fsspec.core.url_to_fs(url)[1]))
            if info is not None:
                found[url] = _remote_identity(info)
    return found


def open_shard(url: str, random_access: bool = False) -> BinaryIO:
    """A binary file object for a path or fsspec URL (the caller closes it). random_access: no
    read-ahead over fsspec, so each read is one ranged request of what it asks for; s3fs would
    otherwise fetch up to its 50 MB block after every backward seek (a shuffled window reads each
    shard out of order)."""
    if "://" not in url:
        return open(url, "rb")
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs.open(path, "rb", **({"cache_type": "none"} if random_access else {}))


# The index of a split's samples in one shard (data/<split>/NNNNNN.npz): where the image and the
# caption of each sample are, in file order. Stored small, since DVC hashes and caches it: sizes in
# the narrowest unsigned type that holds them, offsets as their difference from where the tar
# layout puts them when the members follow each other (<key>.jpg then <key>.txt, each after its
# 512-byte header): 0 for nearly every sample, whatever the shard's size. Every array is stored
# byte-shuffled (its bytes grouped by significance, as HDF5's shuffle filter does), so the
# compressor sees runs of equal high bytes.
_TAR_BLOCK = 512


def _padded(size: np.ndarray) -> np.ndarray:
    return (size + _TAR_BLOCK - 1) // _TAR_BLOCK * _TAR_BLOCK


def _predicted_image_offsets(image_size: np.ndarray, caption_size: np.ndarray) -> np.ndarray:
    """Where each image would start if every sample followed the previous one directly."""
    step = _padded(image_size) + _padded(caption_size) + 2 * _TAR_BLOCK
    return np.concatenate([[_TAR_BLOCK], _TAR_BLOCK + np.cumsum(step[:-1])]).astype(np.int64)


def encode_index(locations: np.ndarray) -> dict[str, Any]:
    """The arrays stored for locations [n, 4] (image offset, size, caption offset, size)."""
    locations = np.asarray(locations, dtype=np.int64).reshape(-1, 4)
    image_at, image_size, text_at, text_size = locations.T
    # offsets as differences between consecutive prediction errors: a skipped sample or an extra
    # member shifts every later offset, and that shift is one value, not one per later sample
    image_error = image_at - _predicted_image_offsets(image_size, text_size)
    arrays = {
        "image_size": image_size,
        "caption_size": text_size,
        "image_offset_error": np.diff(image_error, prepend=0),
        "caption_offset_error": text_at - (image_at + _padded(image_size) + _TAR_BLOCK),
    }
    return {name: _shuffled(_narrowest(a)) for name, a in arrays.items()}


def decode_index(arrays) -> np.ndarray:
    """encode_index's inverse: int64 locations [n, 4]."""
    image_size, text_size, image_error, text_error = (
        _unshuffled(arrays[name])
        for name in ("image_size", "caption_size", "image_offset_error", "caption_offset_error")
    )
    image_at = _predicted_image_offsets(image_size, text_size) + np.cumsum(image_error)
    text_at = image_at + _padded(image_size) + _TAR_BLOCK + text_error
    return np.stack([image_at, image_size, text_at, text_size], axis=1)


def _narrowest(values: np.ndarray) -> np.ndarray:
    low, high = (int(values.min()), int(values.max())) if len(values) else (0, 0)
    for dtype in (np.uint8, np.uint16, np.uint32, np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return values.astype(dtype)
    return values.astype(np.int64)


def _shuffled(values: np.ndarray) -> np.ndarray:
    """[itemsize, n] uint8: byte k of every value, then byte k+1; the dtype is kept in a
    structured view so that _unshuffled needs nothing else."""
    planes = (
        values.astype(values.dtype.newbyteorder("<")).view(np.uint8).reshape(-1, values.itemsize)
    )
    return np.ascontiguousarray(planes.T).view(np.dtype([(values.dtype.str, np.uint8)]))


def _unshuffled(stored: np.ndarray) -> np.ndarray:
    (name,) = stored.dtype.names or ("",)  # _shuffled's one field, named by the dtype
    dtype = np.dtype(name)
    planes = stored.view(np.uint8).reshape(dtype.itemsize, -1)
    return np.ascontiguousarray(planes.T).view(dtype).ravel().astype(np.int64)


_ONE_READ_GAP = 4096  # bytes between an image and its caption still fetched in the same read
_READ_AHEAD_BYTES = 64 * 2**20  # fsspec shards up to this size are read through read-ahead


class InPlaceReader:
    """Random access to the samples of a split in their original shards, by (shard, index):
    ShardReader's interface. Index files are loaded once per shard; a few shards stay open."""

    def __init__(self, index_files: list[Path], shards: list[dict], max_open_files: int = 16):
        self.index_files = index_files
        self.shards = shards
        self.max_open_files = max_open_files
        self._locations: dict[int, np.ndarray] = {}
        self._tokens: dict[int, np.ndarray | None] = {}
        self._files: dict[int, BinaryIO] = {}

    def read(self, shard: int, index: int) -> dict[str, bytes]:
        if shard not in self._locations:
            # bounded like the open files: an epoch visits every shard (32 bytes a sample here)
            if len(self._locations) >= 4 * self.max_open_files:
                self._locations.pop(next(iter(self._locations)))
            with np.load(self.index_files[shard]) as index_file:
                self._locations[shard] = decode_index(index_file)
        image_at, image_size, text_at, text_size = self._locations[shard][index].tolist()
        f = self._file(shard)
        gap = text_at - (image_at + image_size)
        if 0 <= gap <= _ONE_READ_GAP:  # the caption right after the image: one read (request)
            both = _read_at(f, image_at, text_at + text_size - image_at)
            sample = {"jpg": both[:image_size], "txt": both[image_size + gap :]}
        else:
            sample = {
                "jpg": _read_at(f, image_at, image_size),
                "txt": _read_at(f, text_at, text_size),
            }
        tokens = self._shard_tokens(shard)
        if tokens is not None:  # the member a copied shard has
            sample[TOKENS_MEMBER] = tokens[index].tobytes()
        return sample

    def _shard_tokens(self, shard: int) -> np.ndarray | None:
        """The shard's stored ids (data.pretokenize_model), None without. Kept for one window of
        shards only: ~150 bytes a sample (77 uint16 ids), 100 MB a worker for 64 shards of 10k."""
        if shard not in self._tokens:
            if len(self._tokens) >= self.max_open_files:
                self._tokens.pop(next(iter(self._tokens)))
            with np.load(self.index_files[shard]) as index_file:
                names = index_file.files
                self._tokens[shard] = index_file[INDEX_TOKENS] if INDEX_TOKENS in names else None
        return self._tokens[shard]

    def _file(self, shard: int) -> BinaryIO:
        if shard not in self._files:
            entry = self.shards[shard]
            why = changed(entry["url"], entry["identity"])
            if why:
                raise ShardChangedError(f"{entry['url']} changed since the data stage: {why}")
            if len(self._files) >= self.max_open_files:
                self._files.pop(next(iter(self._files))).close()
            # a small shard comes whole in s3fs's read-ahead (one request); a large one is read
            # a sample at a time, since read-ahead refetches its 50 MB block on every seek back
            large = entry["identity"]["size"] > _READ_AHEAD_BYTES
            self._files[shard] = open_shard(entry["url"], random_access=large)
        return self._files[shard]


def _read_at(f: BinaryIO, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)
