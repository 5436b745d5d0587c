"""Shards and images made in a test: a tar of given members, a photo-like JPEG."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A tar of `members` (name, bytes) in that order: a webdataset shard as the tests make one."""
    with tarfile.open(path, "w") as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def textured_jpeg(seed: int, size=(160, 120), quality: int = 92) -> bytes:
    """A photo-like image (smooth colours and grain): one a perceptual hash can tell apart."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
    pixels = np.asarray(image.resize(size, Image.Resampling.BICUBIC)).astype(int)
    pixels += rng.integers(-20, 20, pixels.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()
