"""The `local` source: (image path, caption) records from a folder, a .csv or a .jsonl.

Every record is checked before it can reach a shard; a bad one is skipped with a reason and
counted, never a crash. Reasons: missing_file, empty_file, too_large, corrupt_image,
empty_caption, caption_not_utf8, caption_too_long, missing_caption, bad_record.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from clipforge.data.samples import SkipLog, decode_image
from clipforge.data.splits import split_of_identity

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"}


@dataclass(frozen=True)
class Record:
    image: Path
    caption: str | bytes  # bytes when the caption could not be decoded as UTF-8
    origin: str  # where the record came from, for skip reports


def read_records(path: Path, skips: SkipLog) -> Iterator[Record]:
    if path.is_dir():
        yield from _folder_records(path, skips)
    elif path.suffix.lower() == ".csv":
        yield from _csv_records(path, skips)
    elif path.suffix.lower() in {".jsonl", ".json"}:
        yield from _jsonl_records(path, skips)
    else:
        raise FileNotFoundError(f"data.path {path}: expected a folder, a .csv or a .jsonl file")


def _folder_records(root: Path, skips: SkipLog) -> Iterator[Record]:
    for image in sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
        caption_file = image.with_suffix(".txt")
        if not caption_file.is_file():
            skips.add("missing_caption", str(image))
            continue
        yield Record(image, _decode(caption_file.read_bytes()), str(caption_file))


def _csv_records(path: Path, skips: SkipLog) -> Iterator[Record]:
    # surrogateescape keeps undecodable bytes so one bad caption is skipped, not the whole file
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"image", "caption"} <= set(reader.fieldnames):
            raise ValueError(
                f"{path}: needs a header with columns `image` and `caption`, "
                f"found {reader.fieldnames}"
            )
        for line, row in enumerate(reader, start=2):
            if row["image"] is None or row["caption"] is None:
                skips.add("bad_record", f"{path}:{line}")
                continue
            caption = row["caption"]
            try:
                caption.encode("utf-8")
            except UnicodeEncodeError:
                caption = caption.encode("utf-8", errors="surrogateescape")
            yield Record(path.parent / row["image"], caption, f"{path}:{line}")


def _jsonl_records(path: Path, skips: SkipLog) -> Iterator[Record]:
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            origin = f"{path}:{line_number}"
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
            yield Record(path.parent / item["image"], item["caption"], origin)


def _decode(raw: bytes) -> str | bytes:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def load_image(path: Path, max_pixels: int) -> tuple[bytes | None, str | None]:
    """(JPEG bytes, None) for a readable image within limits, else (None, skip reason)."""
    if not path.is_file():
        return None, "missing_file"
    return decode_image(path.read_bytes(), max_pixels)


def split_of(image: Path, seed: int, val_fraction: float, test_fraction: float) -> str:
    """Deterministic split by image path, so all captions of an image land in the same split."""
    return split_of_identity(image.as_posix(), seed, val_fraction, test_fraction)
