"""What every source does with a candidate pair: clean, decode, check, or skip.

Clean the caption, decode and check the image,
and log a skip with its reason when either is unusable (never a crash)."""

from __future__ import annotations

import io
import warnings
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from PIL import Image


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


# UTF-8 takes at most this many bytes a character: a caption file longer than max_caption_chars
# times this cannot be short enough (whitespace runs aside, which clean_caption collapses).
UTF8_MAX_BYTES = 4


@dataclass(frozen=True)
class SizeLimits:
    """The largest input a source reads into memory (data.max_image_bytes, data.max_caption_chars):
    anything larger is skipped by its size alone, unread, so a file or tar member declaring 4 GiB
    costs nothing."""

    max_image_bytes: int
    max_caption_chars: int

    @classmethod
    def of(cls, data) -> SizeLimits:  # a DataConfig (this module is below clipforge.config)
        return cls(data.max_image_bytes, data.max_caption_chars)

    @property
    def max_caption_bytes(self) -> int:
        return UTF8_MAX_BYTES * self.max_caption_chars

    def skip_reason(self, caption: bool, size: int) -> str | None:
        """`caption_too_long` (a caption of `size` bytes) or `too_large` (an image), None within
        the limits."""
        if caption:
            return "caption_too_long" if size > self.max_caption_bytes else None
        return "too_large" if size > self.max_image_bytes else None


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


def encode_jpeg(image: Image.Image, quality: int = 95) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


# Integer modes PIL gives high-bit-depth greyscale images (16-bit PNG, TIFF): convert("RGB") clips
# every value above 255 to white instead of scaling.
_HIGH_BIT_DEPTH_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I"}


def to_rgb(image: Image.Image) -> Image.Image:
    """An RGB image of any decoded one; 16-bit greyscale is scaled down to 8 bits, not clipped."""
    if image.mode in _HIGH_BIT_DEPTH_MODES:
        values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535) >> 8
        image = Image.fromarray(values.astype(np.uint8))  # 8-bit: mode L
    return image.convert("RGB")


def decode_image(
    raw: bytes, max_pixels: int, keep_jpeg: bool = False
) -> tuple[bytes | None, str | None]:
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
                rgb = to_rgb(image)
    except Image.DecompressionBombError:
        return None, "too_large"
    except Exception:  # PIL raises many types for broken files: all mean the same here
        return None, "corrupt_image"
    return encode_jpeg(rgb), None


def shorter_side_at_most(jpeg: bytes, side: int | None) -> bytes:
    """data.resize_to: the image with its shorter side brought down to `side` pixels, aspect
    kept (re-encoded); an image already that small, or no `side`, unchanged. Training crops from
    the shorter side anyway, so model-sized JPEGs decode in a fraction of the time, every epoch."""
    if not side:
        return jpeg
    with Image.open(io.BytesIO(jpeg)) as image:
        width, height = image.size
        if min(width, height) <= side:
            return jpeg
        scale = side / min(width, height)
        size = (max(side, round(width * scale)), max(side, round(height * scale)))
        return encode_jpeg(image.convert("RGB").resize(size, Image.Resampling.BICUBIC))
