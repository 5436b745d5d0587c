"""Shards used where they are: a manifest of existing webdataset shards instead of a copy.

The data stage (data.in_place) reads the tar headers of every shard, over data.workers
processes, and writes
  data/manifest.json        per shard: its URL, size and identity (mtime or etag, a sampled
                            sha256), samples read and kept; the splits; skips; decontamination
  data/train/NNNNNN.npz     per input shard NNNNNN: where the bytes of each train sample are
  data/val/NNNNNN.npz       (image offset and size, caption offset and size), ~3 bytes a pair
                            (clipforge.data.shards.encode_index); no keys: the shard holds them;
                            with data.pretokenize_model, each caption's token ids too
  data/test/                the test set (Chinese-CLIP layout, copied: eval reads it whole)
so data/ stays megabytes next to a terabyte of shards, and DVC tracks that, not the images.
The split is the same hash of `<shard file name>/<key>` as the copying source uses.

What is checked where:
- captions: every one, here (they are a few bytes next to each image header);
- images: data.verify: `all` decodes every image here, `sample` a fixed VERIFY_SAMPLE_SHARE of
  them (by a hash of the key: a rerun checks the same ones), `none` none; an image that turns out
  corrupt while training is skipped there and counted (train.info.json), never a crash;
- shards: their identity is compared with the manifest when training starts and whenever a
  reader opens one: a shard changed since the data stage ran is an error naming it
  (ShardChangedError), not a silent read of other bytes at the recorded offsets.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tarfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import numpy as np

from clipforge.data import decontam, testset
from clipforge.data.config import DataConfig
from clipforge.data.inputs import expand_paths
from clipforge.data.samples import SizeLimits, SkipLog, clean_caption, decode_image
from clipforge.data.shards import (
    INDEX_TOKENS,
    TOKENIZE_BATCH,
    CaptionTokenizer,
    decode_index,
    encode_index,
    open_shard,
    open_tar,
    shard_identity,
)
from clipforge.data.splits import test_hashes

log = logging.getLogger("clipforge.data")

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
# data.in_place: auto: shards totalling at least this are used in place, smaller ones copied.
AUTO_IN_PLACE_BYTES = 10 * 2**30
# data.verify: sample: the share of images decoded here. 0.1%: 100k images of a 100M-pair set, plenty
# to see a set that is systematically unreadable; single bad images are skipped in training. At
# 1% the decodes cost as much as the whole scan (BENCHMARKS.md).
VERIFY_SAMPLE_SHARE = 0.001


# -- reading tar headers ----------------------------------------------------------------------


class _NeedsTarfile(Exception):
    """A PAX or GNU long-name header: left to the standard library's reader."""


class CutShort(EOFError):
    """A shard ends inside a member (`name`): the members before it are complete."""

    def __init__(self, name: str):
        super().__init__(f"the shard ends inside {name}")
        self.name = name


Found = dict[bytes, tuple[int, int]]  # a sample's members: extension -> (data offset, size)
BLOCK_BYTES = 4096  # one read at a header: it, a caption after it and usually the next header


def shard_samples(f: BinaryIO, size: int) -> Iterator[tuple[bytes, Found, bytes | None]]:
    """(key, {extension: (offset, size)}, the caption's bytes when already read) of each run of
    consecutive members sharing `<key>.`, reading only headers (and captions). ustar headers
    (webdataset's, img2dataset's, Python's) are parsed here; a shard with PAX or GNU extensions
    is handed to tarfile from the sample where one appears. Raises tarfile.ReadError on a damaged
    header and CutShort on a member cut short, after the complete samples before it."""
    try:
        yield from _ustar_samples(f, size)
    except _NeedsTarfile as exc:
        first_header = exc.args[0]
        yield from ((key, found, None) for key, found in _tarfile_samples(f, size, first_header))


_ZERO_BLOCK = bytes(512)
_FILE_KINDS = frozenset(b"0\x007")  # regular files, as byte values
_EXTENDED_KINDS = frozenset(b"xgLK")  # PAX and GNU long-name headers: tarfile reads those


def _ustar_samples(f: BinaryIO, size: int) -> Iterator[tuple[bytes, Found, bytes | None]]:
    # The data stage's cost per pair is this loop (BENCHMARKS.md), hence one function with the
    # block cache, the header parsing and the grouping inline: each call or generator level
    # costs about as much as parsing a header.
    start, block = 0, b""  # the bytes read last, from offset `start`
    position = 0
    key: bytes | None = None
    found: Found = {}
    caption: bytes | None = None
    group_at = 0  # the header offset of the sample being collected
    cut: str | None = None
    read_at = reader_at(f)
    while position + 512 <= size:
        at = position - start
        if at < 0 or at + 512 > len(block):
            start, block, at = position, read_at(position, BLOCK_BYTES), 0
            if len(block) < 512:
                cut = f"a header at byte {position}"
                break
        # fields are read in place in the block: copying the header out costs as much as parsing
        if not block[at] and block[at : at + 512] == _ZERO_BLOCK:  # the end of the archive
            break
        ustar = block.startswith(b"ustar", at + 257)
        # ustar headers are known by their magic and parsed strictly; only others pay for the
        # checksum (a Python sum over 512 bytes)
        if not ustar:
            header = block[at : at + 512]
            if _octal(header[148:156]) != sum(header[:148]) + 256 + sum(header[156:]):
                raise tarfile.ReadError(f"bad header checksum at byte {position}")
        kind = block[at + 156]
        if kind in _EXTENDED_KINDS:
            raise _NeedsTarfile(group_at if key is not None else position)
        try:  # the common case inline: octal digits, NUL or space padded
            length = int(block[at + 124 : at + 136].rstrip(b"\0 ") or b"0", 8)
        except ValueError:
            length = _octal(block[at + 124 : at + 136])
        data = position + 512
        if kind in _FILE_KINDS:
            end = block.find(b"\0", at, at + 100)
            name = block[at : end if end >= 0 else at + 100]
            if ustar and block[at + 345]:
                name = block[at + 345 : at + 500].split(b"\0", 1)[0] + b"/" + name
            directory, _, base = name.rpartition(b"/")
            stem, _, ext = base.partition(b".")
            member_key = directory + b"/" + stem if directory else stem
            if data + length > size:
                cut = name.decode("utf-8", "surrogateescape")
                if member_key == key:  # the sample is cut: it is not complete
                    key = None
                break
            if member_key != key:
                if key is not None:
                    yield key, found, caption
                key, found, caption, group_at = member_key, {}, None, position
            ext = ext.lower()
            found[ext] = (data, length)
            if ext == b"txt" and data + length <= start + len(block):
                caption = block[data - start : data - start + length]
        position = data + (length + 511) // 512 * 512
    else:
        if position < size:
            cut = f"a header at byte {position}"
    if key is not None:
        yield key, found, caption
    if cut is not None:
        raise CutShort(cut)


def reader_at(f: BinaryIO) -> Callable[[int, int], bytes]:
    """read(offset, size): one pread system call for a local file (a seek and a read cost two, a
    third of the scan's time per sample on a page-cached shard); seek + read otherwise."""
    try:
        fd = f.fileno()
    except (AttributeError, OSError):  # fsspec's files have none, or raise
        fd = -1
    if fd >= 0:
        return lambda offset, size: os.pread(fd, size, offset)
    return lambda offset, size: _read(f, (offset, size))


def _tarfile_samples(f: BinaryIO, size: int, first_header: int) -> Iterator[tuple[bytes, Found]]:
    """The samples from the header at first_header on, through tarfile."""
    key: bytes | None = None
    found: Found = {}
    f.seek(0)
    with open_tar(f, "r:") as archive:
        for info in archive:
            if not info.isfile() or info.offset < first_header:
                continue
            member_key, ext = _key_and_extension(info.name.encode("utf-8", "surrogateescape"))
            if info.offset_data + info.size > size:
                if key is not None and member_key != key:
                    yield key, found
                raise CutShort(info.name)
            if member_key != key:
                if key is not None:
                    yield key, found
                key, found = member_key, {}
            found[ext] = (info.offset_data, info.size)
    if key is not None:
        yield key, found


def _key_and_extension(name: bytes) -> tuple[bytes, bytes]:
    directory, _, base = name.rpartition(b"/")
    stem, _, ext = base.partition(b".")
    return (directory + b"/" + stem if directory else stem), ext.lower()


def _octal(field_: bytes) -> int:
    if field_[0] & 0x80:  # GNU base-256, for members over 8 GiB
        return int.from_bytes(field_[1:], "big")
    text = field_.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise tarfile.ReadError(f"not a tar header field: {field_!r}") from None


def member_key(f: BinaryIO, data_offset: int) -> str:
    """The sample key of the member whose data starts at data_offset, from its ustar header (a
    PAX long name shows as ustar's truncated one): the index stores no keys, the shard has them."""
    header = _read(f, (data_offset - 512, 512))
    name = header[:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar" and header[345]:
        name = header[345:500].split(b"\0", 1)[0] + b"/" + name
    return _key_and_extension(name)[0].decode("utf-8", "replace")


# -- scanning one shard (a worker process) ----------------------------------------------------


@dataclass(frozen=True)
class ScanOptions:
    seed: int
    val_fraction: float
    test_fraction: float
    verify: str
    hash_images: bool
    limits: SizeLimits  # members over these are skipped unread
    max_image_pixels: int


HELD_SPLITS = ("train", "val")  # indexed in place; the test split is written out whole


@dataclass
class ShardScan:
    """What a worker hands back for one shard: small. Its train and val samples are in their
    index files (out/<split>/NNNNNN.npz, written by the worker); here are their counts, their
    pHashes when decontaminating (uint64 per row of the index file), and the locations of its
    test samples (a share of the shard, read back once to write the test set)."""

    url: str
    identity: dict
    index_files: dict[str, Path]  # split -> its index file (written only when counts[split])
    counts: dict[str, int]  # kept samples per split
    phashes: dict[str, np.ndarray]
    test_locations: np.ndarray  # int64 [n, 4]
    samples: int = 0
    kept: int = 0  # passed every check here (decontamination may drop some later)
    decoded: int = 0
    error: str | None = None
    skips: SkipLog = field(default_factory=SkipLog)


def scan_shard(
    url: str,
    options: ScanOptions,
    index_files: dict[str, Path],
    tokenize: CaptionTokenizer | None = None,
) -> ShardScan:
    """Every sample of one shard: kept ones indexed by split (with their pHashes, and their
    captions' token ids when `tokenize`: data.pretokenize_model), the rest as skips with their
    reasons (as the copying source names them).

    The loop is the data stage's cost per pair (BENCHMARKS.md): one block read, a caption check
    and one sha256 for nearly every sample; locations go into flat int lists, not objects."""
    identity = shard_identity(url, sampled_hash=True)
    # the split identity `<shard file name>/<key>` as splits.identity_digest hashes it
    prefix = f"{options.seed}:{PurePosixPath(url).name}/".encode()
    test_bound = options.test_fraction
    val_bound = options.test_fraction + options.val_fraction
    sampled = options.verify == "sample"
    verify_all = options.verify == "all"
    max_chars = options.limits.max_caption_chars
    max_caption_bytes, max_image_bytes = (
        options.limits.max_caption_bytes,
        options.limits.max_image_bytes,
    )
    skips = SkipLog()
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])  # flat locations per split code
    phashes: tuple[list[int], list[int]] = ([], [])
    captions: tuple[list[str], list[str]] = ([], [])  # data.pretokenize_model: of train and val
    samples = decoded = 0
    error = None
    try:
        with open_shard(url) as f:
            for key, found, raw_caption in shard_samples(f, identity["size"]):
                samples += 1
                image = found.get(b"jpg") or _image_member(found)
                if image is None:
                    skips.add("missing_image", f"{url}:{_text(key)}")
                    continue
                caption = found.get(b"txt")
                if caption is None:
                    skips.add("missing_caption", f"{url}:{_text(key)}")
                    continue
                if image[1] > max_image_bytes or caption[1] > max_caption_bytes:  # never read
                    too_large = image[1] > max_image_bytes  # as the copy, which meets it first
                    skips.add(
                        "too_large" if too_large else "caption_too_long", f"{url}:{_text(key)}"
                    )
                    continue
                if raw_caption is None:
                    raw_caption = _read(f, caption)
                try:
                    text: str | bytes = raw_caption.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw_caption
                # clean_caption's verdict without its whitespace clean-up, for the usual caption
                if not (isinstance(text, str) and len(text) <= max_chars and not text.isspace()):
                    reason = clean_caption(text, max_chars)[1]
                    if reason:
                        skips.add(reason, f"{url}:{_text(key)}")
                        continue
                digest = hashlib.sha256(prefix + key).digest()
                verified = verify_all or (
                    sampled and int.from_bytes(digest[8:16], "big") / 2**64 < VERIFY_SAMPLE_SHARE
                )
                phash = 0
                if verified or options.hash_images:
                    raw = _read(f, image)
                    decoded += 1
                    reason = None
                    if verified:  # keep_jpeg: a JPEG that decodes is not encoded again
                        reason = decode_image(raw, options.max_image_pixels, keep_jpeg=True)[1]
                    if reason is None and options.hash_images:
                        # a reduced-scale decode still reads the whole JPEG: a cut file fails
                        decoded_image = decontam.open_image(
                            raw, options.max_image_pixels, draft=True
                        )
                        if decoded_image is None:
                            reason = "corrupt_image"
                        else:
                            phash = decontam.perceptual_hash(decoded_image)
                    if reason:
                        skips.add(reason, f"{url}:{_text(key)}")
                        continue
                # splits.split_of_digest, inlined: the same comparisons of the same float
                u = int.from_bytes(digest[:8], "big") / 2**64
                code = 2 if u < test_bound else 1 if u < val_bound else 0
                rows[code].extend((*image, *caption))
                if code < 2 and options.hash_images:
                    phashes[code].append(phash)
                if code < 2 and tokenize is not None:
                    assert isinstance(text, str)  # clean_caption skipped undecodable ones
                    captions[code].append(text)
    except (tarfile.TarError, EOFError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        skips.add("corrupt_shard", f"{url} ({error})")
    locations = [np.array(r, dtype=np.int64).reshape(-1, 4) for r in rows]
    for code, split in enumerate(HELD_SPLITS):
        if len(locations[code]):
            tokens = token_rows(tokenize, captions[code]) if tokenize else None
            write_index(index_files[split], locations[code], tokens)
    return ShardScan(
        url,
        identity,
        index_files,
        {split: len(locations[code]) for code, split in enumerate((*HELD_SPLITS, "test"))},
        {split: np.array(phashes[code], dtype=np.uint64) for code, split in enumerate(HELD_SPLITS)},
        locations[2],
        samples,
        sum(len(rows) for rows in locations),
        decoded,
        error,
        skips,
    )


def write_index(path: Path, locations: np.ndarray, tokens: np.ndarray | None = None) -> None:
    """An index file; `tokens`: each sample's stored token ids (data.pretokenize_model), [n, context
    length] in their TokenFormat's dtype, which the compressor shrinks to about the ids' length
    (the padding is runs of one value)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = encode_index(locations)
    if tokens is not None:
        arrays[INDEX_TOKENS] = tokens
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def token_rows(tokenize: CaptionTokenizer, captions: list[str]) -> np.ndarray:
    """The stored ids of `captions` as one array, TOKENIZE_BATCH captions per call."""
    token_format = tokenize.format
    stored = [
        row
        for start in range(0, len(captions), TOKENIZE_BATCH)
        for row in tokenize(captions[start : start + TOKENIZE_BATCH])
    ]
    flat = np.frombuffer(b"".join(stored), dtype=token_format.dtype)
    return flat.reshape(len(captions), token_format.context_length)


def read_index(path: Path) -> np.ndarray:
    with np.load(path) as f:
        return decode_index(f)


def _image_member(found: dict[bytes, tuple[int, int]]) -> tuple[int, int] | None:
    return next((found[e] for e in _IMAGE_EXTENSIONS if e in found), None)


_IMAGE_EXTENSIONS = tuple(e.encode() for e in IMAGE_EXTENSIONS)


def _text(key: bytes) -> str:
    return key.decode("utf-8", "replace")


def _read(f: BinaryIO, location: tuple[int, int]) -> bytes:
    f.seek(location[0])
    return f.read(location[1])


# A worker process's tokenizer (data.pretokenize_model), given once when it starts: pickled with
# every job, a tokenizer's vocabulary (MBs) would cross to the workers once per shard.
_worker_tokenize: CaptionTokenizer | None = None


def _set_worker_tokenize(tokenize: CaptionTokenizer | None) -> None:
    global _worker_tokenize
    _worker_tokenize = tokenize


def _scan(args: tuple[str, ScanOptions, dict[str, Path]]) -> ShardScan:
    return scan_shard(*args, _worker_tokenize)


def scan_all(
    files: list[str],
    options: ScanOptions,
    workers: int,
    out: Path,
    tokenize: CaptionTokenizer | None = None,
) -> Iterator[ShardScan]:
    """scan_shard over every file, in input order, over `workers` processes; shard n's index
    files are out/<split>/NNNNNN.npz (n: its place in `files`)."""
    jobs = [
        (url, options, {split: out / split / f"{n:06d}.npz" for split in HELD_SPLITS})
        for n, url in enumerate(files)
    ]
    if workers <= 1 or len(files) <= 1:
        yield from (scan_shard(*job, tokenize) for job in jobs)
        return
    with ProcessPoolExecutor(
        max_workers=min(workers, len(files)),
        initializer=_set_worker_tokenize,
        initargs=(tokenize,),
    ) as pool:
        # a few shards per task: 100k shards are 100k round trips to the workers otherwise
        chunk = max(1, min(16, len(jobs) // (8 * workers)))
        yield from pool.map(_scan, jobs, chunksize=chunk)


# -- the data stage's in-place build ----------------------------------------------------------


def use_in_place(data: DataConfig, files: list[str]) -> bool:
    """data.in_place, with `auto` decided by the shards' total size (AUTO_IN_PLACE_BYTES)."""
    if data.in_place != "auto":
        return bool(data.in_place)
    total = 0
    for url in files:
        total += shard_identity(url)["size"]
        if total >= AUTO_IN_PLACE_BYTES:
            return True
    return False


def num_workers(data: DataConfig) -> int:
    return os.cpu_count() or 1 if data.workers == "auto" else int(data.workers)


def build_splits(
    data: DataConfig,
    out: Path,
    skips: SkipLog,
    files: list[str] | None = None,
    kind: str = "",
    tokenize: CaptionTokenizer | None = None,
) -> tuple[dict, dict, dict]:
    """Index the shards of data.paths (or `files`) into out/ (with each sample's token ids
    when `tokenize`: data.pretokenize_model); returns (splits, source, decontamination) for the
    manifest."""
    files = files if files is not None else expand_paths(data.paths, "webdataset .tar shards")
    # absolute: the train stage may run from another directory than this stage did
    files = [url if "://" in url else os.path.abspath(url) for url in files]
    options = ScanOptions(
        seed=data.seed,
        val_fraction=data.val_fraction,
        test_fraction=0.0 if data.test_dir else data.test_fraction,
        verify=data.verify,
        hash_images=data.decontaminate != "off",
        limits=SizeLimits.of(data),
        max_image_pixels=data.max_image_pixels,
    )
    scans = []
    for scan in scan_all(files, options, num_workers(data), out, tokenize):
        _merge_skips(skips, scan.skips)
        scans.append(scan)
    test_split = None
    if data.test_dir:
        tests = testset.load_test_set(Path(data.test_dir))
        test_items = list(zip(tests.image_ids, tests.images))
        test_sha = test_hashes(Path(data.test_dir))["sha256"]
    else:
        test_split, test_items = _write_test_split(scans, data, out)
        test_sha = test_split["sha256"]
    record = decontam.not_checked("data.decontaminate: off")
    if data.decontaminate != "off":
        test = decontam.TestHashes.of(test_items, data.max_image_pixels, test_sha)
        record = _decontaminate(scans, test, data).to_dict()
    splits = {split: _split_entry(scans, out, split) for split in HELD_SPLITS}
    if test_split is not None:
        splits["test"] = test_split
    source = {
        "type": kind or "webdataset",
        "paths": list(data.paths),
        "seed": data.seed,
        "in_place": True,
        "verify": data.verify,
        "images_decoded": sum(s.decoded for s in scans),
        "shards": [
            {
                "shard": s.url,
                "identity": s.identity,
                "samples": s.samples,
                "kept": s.kept,
                "error": s.error,
            }
            for s in scans
        ],
    }
    return splits, source, record


def _merge_skips(into: SkipLog, other: SkipLog) -> None:
    for reason, count in other.counts.items():
        examples = other.examples.get(reason, [])
        for example in examples:
            into.add(reason, example)
        into.counts[reason] += count - len(examples)


def _write_test_split(scans: list[ShardScan], data: DataConfig, out: Path):
    """The source's test images into out/test (converted to JPEG); (split entry, items)."""
    items = []

    def images():
        image_id = 0
        for scan in scans:
            if not len(scan.test_locations):
                continue
            with open_shard(scan.url) as f:
                for image_at, image_size, text_at, text_size in scan.test_locations.tolist():
                    raw = _read(f, (image_at, image_size))
                    jpeg, reason = decode_image(raw, data.max_image_pixels)
                    if reason:  # not every image is verified while scanning: keep good ones
                        continue
                    caption = " ".join(_read(f, (text_at, text_size)).decode("utf-8").split())
                    items.append((image_id, jpeg))
                    yield image_id, jpeg, [caption]
                    image_id += 1

    counts = testset.write_test_set(out / "test", images())
    return {**counts, **test_hashes(out / "test")}, items


def _decontaminate(
    scans: list[ShardScan], test: decontam.TestHashes, data: DataConfig
) -> decontam.Findings:
    """Compare every train and val sample with the test images; with data.decontaminate `drop`,
    take the matches out of their index files (rewritten: matches are rare)."""
    findings = decontam.Findings(
        data.decontaminate, data.decontaminate_max_distance, len(test.image_ids), test.sha256
    )
    for scan in scans:
        for split in HELD_SPLITS:
            hashes = scan.phashes[split]
            findings.checked += len(hashes)
            if not len(hashes) or not len(test.image_ids):
                continue
            closest = decontam.closest_matches(
                hashes, test.phashes, data.decontaminate_max_distance
            )
            if not closest:
                continue
            locations = read_index(scan.index_files[split])
            with np.load(scan.index_files[split]) as index_file:
                tokens = index_file[INDEX_TOKENS] if INDEX_TOKENS in index_file.files else None
            with open_shard(scan.url) as f:
                for row, (column, distance) in sorted(closest.items()):
                    image_at, image_size = locations[row][:2].tolist()
                    raw = _read(f, (image_at, image_size))
                    image = decontam.open_image(raw, data.max_image_pixels)
                    pixels = decontam.pixel_hash(image) if image is not None else None
                    kind = "exact" if pixels == test.pixel_hashes[column] else "near"
                    findings.add(
                        f"{scan.url}:{member_key(f, image_at)}",
                        split,
                        test.image_ids[column],
                        distance,
                        kind,
                    )
            if data.decontaminate == "drop":
                kept = np.delete(locations, sorted(closest), axis=0)
                if tokens is not None:
                    tokens = np.delete(tokens, sorted(closest), axis=0)
                scan.counts[split] = len(kept)
                if len(kept):
                    write_index(scan.index_files[split], kept, tokens)
                else:
                    scan.index_files[split].unlink()
    return findings


def _split_entry(scans: list[ShardScan], out: Path, split: str) -> dict:
    (out / split).mkdir(parents=True, exist_ok=True)
    shards = [
        {
            "name": scan.index_files[split].relative_to(out).as_posix(),
            "url": scan.url,
            "identity": scan.identity,
            "count": scan.counts[split],
        }
        for scan in scans
        if scan.counts[split]
    ]
    return {"count": sum(s["count"] for s in shards), "in_place": True, "shards": shards}
