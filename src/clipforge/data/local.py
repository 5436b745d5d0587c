"""The `local` source: (image path, caption) records from a folder, a .csv or a .jsonl.

Every record is checked before it can reach a shard; a bad one is skipped with a reason and
counted, never a crash. Reasons: missing_file, empty_file, too_large, corrupt_image,
empty_caption, caption_not_utf8, caption_too_long, missing_caption, bad_record.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from PIL import Image

from clipforge.data.builtin import encode_jpeg

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"}


@dataclass(frozen=True)
class Record:
    image: Path
    caption: str | bytes  # bytes when the caption could not be decoded as UTF-8
    origin: str  # where the record came from, for skip reports


@dataclass
class SkipLog:
    """Counts of skipped items by reason, and the first few examples of each."""
    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    max_examples: int = 20

    def add(self, reason: str, item: str) -> None:
        self.counts[reason] += 1
        bucket = self.examples.setdefault(reason, [])
        if len(bucket) < self.max_examples:
            bucket.append(item)

    def to_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "examples": self.examples}


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
            raise ValueError(f"{path}: needs a header with columns `image` and `caption`, "
                             f"found {reader.fieldnames}")
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
            if not isinstance(item, dict) or not isinstance(item.get("image"), str) \
                    or not isinstance(item.get("caption"), str):
                skips.add("bad_record", origin)
                continue
            yield Record(path.parent / item["image"], item["caption"], origin)


def _decode(raw: bytes) -> str | bytes:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def clean_caption(caption: str | bytes, max_chars: int) -> tuple[str | None, str | None]:
    """(caption, None) when usable, else (None, skip reason)."""
    if isinstance(caption, bytes):
        return None, "caption_not_utf8"
    text = " ".join(caption.split())
    if not text:
        return None, "empty_caption"
    if len(text) > max_chars:
        return None, "caption_too_long"
    return text, None


def load_image(path: Path, max_pixels: int) -> tuple[bytes | None, str | None]:
    """(JPEG bytes, None) for a readable image within limits, else (None, skip reason)."""
    if not path.is_file():
        return None, "missing_file"
    return decode_image(path.read_bytes(), max_pixels)


def decode_image(raw: bytes, max_pixels: int,
                 keep_jpeg: bool = False) -> tuple[bytes | None, str | None]:
    """(JPEG bytes, None) for a decodable image within limits, else (None, skip reason).
    keep_jpeg: an RGB JPEG that decodes is returned as it came (no second lossy encoding)."""
    if not raw:
        return None, "empty_file"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw)) as image:
                width, height = image.size  # header only: cheap, before any decoding
                if width * height > max_pixels:
                    return None, "too_large"
                image.load()
                if keep_jpeg and image.format == "JPEG" and image.mode == "RGB":
                    return raw, None
                rgb = image.convert("RGB")
    except Image.DecompressionBombError:
        return None, "too_large"
    except Exception:  # PIL raises many types for broken files: all mean the same here
        return None, "corrupt_image"
    return encode_jpeg(rgb), None


def split_of(image: Path, seed: int, val_fraction: float, test_fraction: float) -> str:
    """Deterministic split by image path, so all captions of an image land in the same split."""
    return split_of_identity(image.as_posix(), seed, val_fraction, test_fraction)


def split_of_identity(identity: str, seed: int, val_fraction: float, test_fraction: float) -> str:
    """`train`, `val` or `test` from a hash of what identifies an image (a path, a URL)."""
    digest = hashlib.sha256(f"{seed}:{identity}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"
