"""Shards used where they are: a manifest of existing webdataset shards instead of a copy.

The data stage (data.in_place) reads the tar headers of every shard, over data.workers
processes, and writes
  data/manifest.json        per shard: its URL, size and identity (mtime or etag, a sampled
                            sha256), samples read and kept; the splits; skips; decontamination
  data/train/NNNNNN.npz     per input shard NNNNNN: where the bytes of each train sample are
  data/val/NNNNNN.npz       (image offset and size, caption offset and size) and its key
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

import logging
import os
import shutil
import tarfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import numpy as np

from clipforge.config import DataConfig
from clipforge.data import decontam, testset
from clipforge.data.inputs import expand_paths
from clipforge.data.samples import SkipLog, clean_caption, decode_image
from clipforge.data.shards import open_shard, shard_identity
from clipforge.data.splits import identity_digest, split_of_digest, test_hashes

log = logging.getLogger("clipforge.data")

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
# data.in_place: auto: shards totalling at least this are used in place, smaller ones copied.
AUTO_IN_PLACE_BYTES = 10 * 2**30
VERIFY_SAMPLE_SHARE = 0.01  # data.verify: sample: the share of images decoded here
_SPLIT_CODES = {"train": 0, "val": 1, "test": 2}


# -- reading tar headers ----------------------------------------------------------------------


class _NeedsTarfile(Exception):
    """A PAX or GNU long-name header: left to the standard library's reader."""


class CutShort(EOFError):
    """A shard ends inside a member (`name`): the members before it are complete."""

    def __init__(self, name: str):
        super().__init__(f"the shard ends inside {name}")
        self.name = name


def tar_members(f: BinaryIO, size: int) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, data size) of each regular file, reading only the 512-byte headers
    (ustar; PAX and GNU extensions through tarfile). Raises tarfile.ReadError on a damaged
    header and CutShort on a member cut short, after the complete ones."""
    try:
        yield from _ustar_members(f, size)
    except _NeedsTarfile as exc:
        done = exc.args[0]
        f.seek(0)
        with tarfile.open(fileobj=f, mode="r:") as archive:
            for info in archive:
                if info.isfile() and info.offset_data >= done:
                    if info.offset_data + info.size > size:
                        raise CutShort(info.name) from None
                    yield info.name, info.offset_data, info.size


_ZERO_BLOCK = bytes(512)


def _ustar_members(f: BinaryIO, size: int) -> Iterator[tuple[str, int, int]]:
    position = 0
    while position + 512 <= size:
        f.seek(position)
        header = f.read(512)
        if header == _ZERO_BLOCK:
            return
        # ustar/PAX headers (webdataset's, img2dataset's, Python's) are known by their magic and
        # parsed strictly; only others pay for the checksum (a Python sum over 512 bytes)
        if header[257:262] != b"ustar":
            stored = _octal(header[148:156])
            if stored != sum(header[:148]) + 256 + sum(header[156:]):
                raise tarfile.ReadError(f"bad header checksum at byte {position}")
        kind = header[156:157]
        if kind in (b"x", b"g", b"L", b"K"):
            raise _NeedsTarfile(position)
        name = header[:100].split(b"\0", 1)[0]
        if header[345] and header[257:262] == b"ustar":
            name = header[345:500].split(b"\0", 1)[0] + b"/" + name
        try:  # the common case inline: octal digits, NUL or space padded
            length = int(header[124:136].rstrip(b"\0 ") or b"0", 8)
        except ValueError:
            length = _octal(header[124:136])
        data = position + 512
        if kind in (b"0", b"\0", b"7"):
            text = name.decode("utf-8", "surrogateescape")
            if data + length > size:
                raise CutShort(text)
            yield text, data, length
        position = data + (length + 511) // 512 * 512
    if position < size:
        raise CutShort(f"a header at byte {position}")


def _octal(field_: bytes) -> int:
    if field_[0] & 0x80:  # GNU base-256, for members over 8 GiB
        return int.from_bytes(field_[1:], "big")
    text = field_.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise tarfile.ReadError(f"not a tar header field: {field_!r}") from None


def grouped_samples(
    members: Iterator[tuple[str, int, int]],
) -> Iterator[tuple[str, dict[str, tuple[int, int]]]]:
    """(key, {extension: (offset, size)}): runs of consecutive members sharing `<key>.`."""
    key: str | None = None
    found: dict[str, tuple[int, int]] = {}
    try:
        for name, offset, size in members:
            member_key, ext = _key_and_extension(name)
            if member_key != key:
                if key is not None:
                    yield key, found
                key, found = member_key, {}
            found[ext] = (offset, size)
    except CutShort as exc:  # the sample before the cut member is complete unless it is its own
        if key is not None and _key_and_extension(exc.name)[0] != key:
            yield key, found
        raise
    if key is not None:
        yield key, found


def _key_and_extension(name: str) -> tuple[str, str]:
    directory, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext.lower()


# -- scanning one shard (a worker process) ----------------------------------------------------


@dataclass(frozen=True)
class ScanOptions:
    seed: int
    val_fraction: float
    test_fraction: float
    verify: str
    hash_images: bool
    max_caption_chars: int
    max_image_pixels: int


@dataclass
class ShardScan:
    """What a worker hands back for one shard: small. The locations and keys of its kept samples
    are in its scan file (scan_dir/NNNNNN.npz), so the parent holds 9 bytes per sample."""

    url: str
    identity: dict
    scan_file: Path
    splits: np.ndarray  # uint8 per kept sample: 0 train, 1 val, 2 test, 3 dropped
    phashes: np.ndarray  # uint64 per kept sample (0 when images are not hashed)
    samples: int = 0
    decoded: int = 0
    error: str | None = None
    skips: SkipLog = field(default_factory=SkipLog)

    @property
    def kept(self) -> int:
        return len(self.splits)

    def index(self) -> tuple[np.ndarray, np.ndarray]:
        """(locations: int64 [kept, 4] image offset, size, caption offset, size; keys as UTF-8
        bytes)."""
        with np.load(self.scan_file) as f:
            return f["locations"], f["keys"]


def scan_shard(url: str, options: ScanOptions, scan_file: Path) -> ShardScan:
    """Every sample of one shard: kept ones with their locations, split and pHash; the rest as
    skips with their reasons (as the copying source names them)."""
    identity = shard_identity(url, sampled_hash=True)
    name = PurePosixPath(url).name
    skips = SkipLog()
    keys: list[str] = []
    locations: list[tuple[int, int, int, int]] = []
    splits: list[int] = []
    phashes: list[int] = []
    samples = decoded = 0
    error = None
    try:
        with open_shard(url) as f:
            for key, found in grouped_samples(tar_members(f, identity["size"])):
                samples += 1
                ext = "jpg" if "jpg" in found else _image_extension(found)
                if ext is None:
                    skips.add("missing_image", f"{url}:{key}")
                    continue
                if "txt" not in found:
                    skips.add("missing_caption", f"{url}:{key}")
                    continue
                raw_caption = _read(f, found["txt"])
                try:
                    text: str | bytes = raw_caption.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw_caption
                _, reason = clean_caption(text, options.max_caption_chars)
                if reason:
                    skips.add(reason, f"{url}:{key}")
                    continue
                digest = identity_digest(f"{name}/{key}", options.seed)
                verified = _verified(digest, options.verify)
                phash = 0
                if verified or options.hash_images:
                    raw = _read(f, found[ext])
                    decoded += 1
                    if verified:  # keep_jpeg: a JPEG that decodes is not encoded again
                        _, reason = decode_image(raw, options.max_image_pixels, keep_jpeg=True)
                    if reason is None and options.hash_images:
                        # a reduced-scale decode still reads the whole JPEG: a cut file fails
                        image = decontam.open_image(raw, options.max_image_pixels, draft=True)
                        if image is None:
                            reason = "corrupt_image"
                        else:
                            phash = decontam.perceptual_hash(image)
                    if reason:
                        skips.add(reason, f"{url}:{key}")
                        continue
                split = split_of_digest(digest, options.val_fraction, options.test_fraction)
                keys.append(key)
                locations.append((*found[ext], *found["txt"]))
                splits.append(_SPLIT_CODES[split])
                phashes.append(phash)
    except (tarfile.TarError, EOFError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        skips.add("corrupt_shard", f"{url} ({error})")
    with open(scan_file, "wb") as f:
        np.savez(
            f,
            locations=np.array(locations, dtype=np.int64).reshape(-1, 4),
            keys=np.array([k.encode("utf-8", "surrogateescape") for k in keys], dtype=np.bytes_),
        )
    return ShardScan(
        url,
        identity,
        scan_file,
        np.array(splits, dtype=np.uint8),
        np.array(phashes, dtype=np.uint64),
        samples,
        decoded,
        error,
        skips,
    )


def _image_extension(found: dict) -> str | None:
    return next((e for e in IMAGE_EXTENSIONS if e in found), None)


def _read(f: BinaryIO, location: tuple[int, int]) -> bytes:
    f.seek(location[0])
    return f.read(location[1])


def _verified(digest: bytes, verify: str) -> bool:
    """data.verify for one sample; `sample` by bytes of its split hash that the split ignores."""
    if verify == "sample":
        return int.from_bytes(digest[8:16], "big") / 2**64 < VERIFY_SAMPLE_SHARE
    return verify == "all"


def _scan(args: tuple[str, ScanOptions, Path]) -> ShardScan:
    return scan_shard(*args)


def scan_all(
    files: list[str], options: ScanOptions, workers: int, scan_dir: Path
) -> Iterator[ShardScan]:
    """scan_shard over every file, in input order, over `workers` processes."""
    scan_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(url, options, scan_dir / f"{n:06d}.npz") for n, url in enumerate(files)]
    if workers <= 1 or len(files) <= 1:
        yield from (scan_shard(*job) for job in jobs)
        return
    with ProcessPoolExecutor(max_workers=min(workers, len(files))) as pool:
        yield from pool.map(_scan, jobs, chunksize=1)


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
    data: DataConfig, out: Path, skips: SkipLog, files: list[str] | None = None, kind: str = ""
) -> tuple[dict, dict, dict]:
    """Index the shards of data.paths (or `files`) into out/; returns (splits, source,
    decontamination) for the manifest."""
    files = files if files is not None else expand_paths(data.paths, "webdataset .tar shards")
    # absolute: the train stage may run from another directory than this stage did
    files = [url if "://" in url else os.path.abspath(url) for url in files]
    options = ScanOptions(
        seed=data.seed,
        val_fraction=data.val_fraction,
        test_fraction=0.0 if data.test_dir else data.test_fraction,
        verify=data.verify,
        hash_images=data.decontaminate != "off",
        max_caption_chars=data.max_caption_chars,
        max_image_pixels=data.max_image_pixels,
    )
    scan_dir = out / ".scan"
    scans = []
    for scan in scan_all(files, options, num_workers(data), scan_dir):
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
    splits = {split: _write_index(scans, out, split) for split in ("train", "val")}
    if test_split is not None:
        splits["test"] = test_split
    shutil.rmtree(scan_dir)
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


DROPPED = 3


def _write_test_split(scans: list[ShardScan], data: DataConfig, out: Path):
    """The source's test images into out/test (converted to JPEG); (split entry, items)."""
    items = []

    def images():
        image_id = 0
        for scan in scans:
            rows = np.nonzero(scan.splits == _SPLIT_CODES["test"])[0]
            if not len(rows):
                continue
            locations, _ = scan.index()
            with open_shard(scan.url) as f:
                for row in rows:
                    image_at, image_size, text_at, text_size = locations[row].tolist()
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
    """Compare every train and val sample with the test images; mark matches DROPPED when
    data.decontaminate is `drop`."""
    findings = decontam.Findings(
        data.decontaminate, data.decontaminate_max_distance, len(test.image_ids), test.sha256
    )
    for scan in scans:
        held = np.nonzero(scan.splits < _SPLIT_CODES["test"])[0]
        findings.checked += len(held)
        if not len(held) or not len(test.image_ids):
            continue
        rows, columns, distances = decontam.hamming_matches(
            scan.phashes[held], test.phashes, data.decontaminate_max_distance
        )
        closest: dict[int, tuple[int, int]] = {}  # sample row -> (test column, distance)
        for row, column, distance in zip(held[rows].tolist(), columns.tolist(), distances.tolist()):
            if row not in closest or distance < closest[row][1]:
                closest[row] = (column, distance)
        if not closest:
            continue
        locations, keys = scan.index()
        with open_shard(scan.url) as f:
            for row, (column, distance) in sorted(closest.items()):
                image_at, image_size = locations[row][:2].tolist()
                image = decontam.open_image(_read(f, (image_at, image_size)), data.max_image_pixels)
                pixels = decontam.pixel_hash(image) if image is not None else None
                kind = "exact" if pixels == test.pixel_hashes[column] else "near"
                split = "train" if scan.splits[row] == _SPLIT_CODES["train"] else "val"
                findings.add(
                    f"{scan.url}:{keys[row].decode('utf-8', 'replace')}",
                    split,
                    test.image_ids[column],
                    distance,
                    kind,
                )
                if data.decontaminate == "drop":
                    scan.splits[row] = DROPPED
    return findings


def _write_index(scans: list[ShardScan], out: Path, split: str) -> dict:
    code = _SPLIT_CODES[split]
    (out / split).mkdir(parents=True, exist_ok=True)
    shards = []
    for number, scan in enumerate(scans):
        rows = np.nonzero(scan.splits == code)[0]
        if not len(rows):
            continue
        locations, keys = scan.index()
        name = f"{split}/{number:06d}.npz"
        with open(out / name, "wb") as f:
            # compressed: offsets grow steadily and keys share prefixes (DVC hashes these files)
            np.savez_compressed(f, locations=locations[rows], keys=keys[rows])
        shards.append(
            {"name": name, "url": scan.url, "identity": scan.identity, "count": len(rows)}
        )
    return {"count": sum(s["count"] for s in shards), "in_place": True, "shards": shards}
