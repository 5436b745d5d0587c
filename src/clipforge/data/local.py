"""The `local` source: (image path, caption) records from a folder, a .csv or a .jsonl.

Every record is checked before it can reach a shard; a bad one is skipped with a reason and
counted, never a crash. Reasons: missing_file, is_a_directory, symlink_loop, not_a_regular_file,
unreadable, outside_source, empty_file, too_large, corrupt_image, empty_caption, caption_not_utf8,
caption_too_long, missing_caption (a folder image without its .txt), missing_image (a folder
.txt without its image), bad_record.

A .csv or .jsonl names images relative to its own folder, the source root. A path that leaves it
(`../x.jpg`, an absolute path elsewhere) is skipped as `outside_source` unless
`data.allow_paths_outside_source` is set: a list of pairs handed over by someone else must not
pull arbitrary files of this machine into shards that get shared. The check is on the path as
written; symbolic links inside the root are the folder owner's own choice and are followed.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from clipforge.data.samples import SizeLimits, SkipLog, decode_image
from clipforge.data.splits import split_of_identity
from clipforge.errors import StageError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"}


@dataclass(frozen=True)
class Record:
    image: Path
    caption: str | bytes  # bytes when the caption could not be decoded as UTF-8
    origin: str  # where the record came from, for skip reports


def read_records(
    path: Path, skips: SkipLog, limits: SizeLimits, allow_outside: bool = False
) -> Iterator[Record]:
    """The records of a folder, .csv or .jsonl, nothing held but one record: a caption file or a
    line larger than `limits` allow is skipped unread (caption_too_long, bad_record)."""
    if path.is_dir():
        yield from _folder_records(path, skips, limits)
    elif path.suffix.lower() == ".csv":
        yield from _csv_records(path, skips, limits, allow_outside)
    elif path.suffix.lower() in {".jsonl", ".json"}:
        yield from _jsonl_records(path, skips, limits, allow_outside)
    else:
        raise StageError(f"data.path {path}: expected a folder, a .csv or a .jsonl file")


# A line of a .csv or .jsonl holds a caption, an image path and some syntax: this much beside the
# caption's largest size in bytes.
_LINE_OVERHEAD_BYTES = 64 * 1024


def _bounded_lines(f: BinaryIO, max_bytes: int) -> Iterator[bytes | None]:
    """The lines of a binary file, None for one longer than `max_bytes` (read past in chunks,
    never held whole)."""
    while line := f.readline(max_bytes + 1):
        if len(line) <= max_bytes or line.endswith(b"\n"):
            yield line
            continue
        while (rest := f.readline(_LINE_OVERHEAD_BYTES)) and not rest.endswith(b"\n"):
            pass
        yield None


def _folder_records(root: Path, skips: SkipLog, limits: SizeLimits) -> Iterator[Record]:
    files = sorted(root.rglob("*"))
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    stems = {p.with_suffix("") for p in images}
    for caption_file in (p for p in files if p.suffix.lower() == ".txt"):
        if caption_file.with_suffix("") not in stems:
            skips.add("missing_image", str(caption_file))
    for image in images:
        caption_file = image.with_suffix(".txt")
        if not caption_file.is_file():
            skips.add("missing_caption", str(image))
            continue
        try:
            with open(caption_file, "rb") as f:
                raw = f.read(limits.max_caption_bytes + 1)
        except OSError:
            skips.add("unreadable", str(caption_file))
            continue
        if len(raw) > limits.max_caption_bytes:
            skips.add("caption_too_long", str(caption_file))
            continue
        yield Record(image, _decode(raw), str(caption_file))


# What a .csv line too long to read stands for (_csv_lines): a row of one field, no caption, which
# _csv_records counts as a bad_record like any row missing one.
_TOO_LONG_LINE = "-\n"


def _csv_lines(f: BinaryIO, max_bytes: int) -> Iterator[str]:
    # surrogateescape keeps undecodable bytes so one bad caption is skipped, not the whole file
    for line in _bounded_lines(f, max_bytes):
        yield _TOO_LONG_LINE if line is None else line.decode("utf-8", "surrogateescape")


def _csv_records(
    path: Path, skips: SkipLog, limits: SizeLimits, allow_outside: bool
) -> Iterator[Record]:
    # csv's own limit on a field (131,072 characters) is the caption limit's business here
    csv.field_size_limit(max(csv.field_size_limit(), limits.max_caption_bytes))
    with open(path, "rb") as f:
        reader = csv.DictReader(_csv_lines(f, limits.max_caption_bytes + _LINE_OVERHEAD_BYTES))
        if not reader.fieldnames or not {"image", "caption"} <= set(reader.fieldnames):
            raise StageError(
                f"{path}: needs a header with columns `image` and `caption`, "
                f"found {reader.fieldnames}"
            )
        for line, row in enumerate(_csv_rows(reader), start=2):
            origin = f"{path}:{line}"
            if row is None or row["image"] is None or row["caption"] is None:
                skips.add("bad_record", origin)
                continue
            image = _image_path(path.parent, row["image"], allow_outside)
            if image is None:
                skips.add("outside_source", origin)
                continue
            caption = row["caption"]
            try:
                caption.encode("utf-8")
            except UnicodeEncodeError:
                caption = caption.encode("utf-8", errors="surrogateescape")
            yield Record(image, caption, origin)


def _csv_rows(reader: csv.DictReader) -> Iterator[dict | None]:
    """The rows, None for one csv cannot parse (a field over its size limit: an unclosed quote
    that would take the rest of the file)."""
    while True:
        try:
            yield next(reader)
        except StopIteration:
            return
        except csv.Error:
            yield None


def _jsonl_records(
    path: Path, skips: SkipLog, limits: SizeLimits, allow_outside: bool
) -> Iterator[Record]:
    with open(path, "rb") as f:
        lines = _bounded_lines(f, limits.max_caption_bytes + _LINE_OVERHEAD_BYTES)
        for line_number, raw in enumerate(lines, start=1):
            origin = f"{path}:{line_number}"
            if raw is None:
                skips.add("bad_record", origin)
                continue
            if not raw.strip():
                continue
            try:
                item = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                skips.add("caption_not_utf8", origin)
                continue
            except json.JSONDecodeError:
                skips.add("bad_record", origin)
                continue
            if (
                not isinstance(item, dict)
                or not isinstance(item.get("image"), str)
                or not isinstance(item.get("caption"), str)
            ):
                skips.add("bad_record", origin)
                continue
            image = _image_path(path.parent, item["image"], allow_outside)
            if image is None:
                skips.add("outside_source", origin)
                continue
            yield Record(image, item["caption"], origin)


def _image_path(root: Path, name: str, allow_outside: bool) -> Path | None:
    """The image a row names, relative to the source root; None when it leaves the root (as
    written: `..` components or an absolute path) and that is not allowed."""
    image = Path(os.path.normpath(root / name))
    if allow_outside or image.is_relative_to(os.path.normpath(root)):
        return image
    return None


def _decode(raw: bytes) -> str | bytes:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def load_image(path: Path, max_pixels: int, limits: SizeLimits) -> tuple[bytes | None, str | None]:
    """(JPEG bytes, None) for a readable image within limits, else (None, skip reason)."""
    try:
        info = path.stat()
    except FileNotFoundError:  # a dangling symbolic link included
        return None, "missing_file"
    except OSError as exc:
        return None, "symlink_loop" if exc.errno == errno.ELOOP else "unreadable"
    if stat.S_ISDIR(info.st_mode):
        return None, "is_a_directory"
    if not stat.S_ISREG(info.st_mode):  # a FIFO or a device: reading it could block for ever
        return None, "not_a_regular_file"
    too_large = limits.skip_reason(False, info.st_size)
    if too_large:
        return None, too_large
    try:
        raw = path.read_bytes()
    except OSError:
        return None, "unreadable"
    return decode_image(raw, max_pixels)


def split_of(image: Path, seed: int, val_fraction: float, test_fraction: float) -> str:
    """Deterministic split by image path, so all captions of an image land in the same split."""
    return split_of_identity(image.as_posix(), seed, val_fraction, test_fraction)
