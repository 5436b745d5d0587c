"""The `webdataset` source: shards a user already has, checked and re-written into data/.

data.paths lists the shards: paths, globs, `{000000..000099}` ranges or fsspec URLs (s3://...);
each is streamed once (tarfile in stream mode over fsspec: no local copy of remote shards).
A sample is the run of consecutive members sharing a key (`<key>.<ext>`, webdataset's
convention); it needs an image (jpg, jpeg, png or webp) and a caption (txt). Every problem is a
skip with a reason, as in the `local` source: missing_image, missing_caption, corrupt_image,
too_large, empty_caption, caption_not_utf8, caption_too_long; a shard that is not a readable
tar, or ends early, counts once as corrupt_shard, keeping the complete samples before the
damage. Memory stays bounded whatever a shard declares: a member over data.max_image_bytes (an
image) or 4 bytes a character of data.max_caption_chars (a caption) is skipped unread, as are
members of other extensions, and tar's own extended headers are held to 1 MiB
(clipforge.data.shards.open_tar). The manifest lists, per input shard, how many samples were
read and kept.

This copies: JPEGs pass through unchanged (other formats are converted), data.resize_to applies,
and the cost is one sequential copy in one process, about 1,000 pairs per CPU-second. The copy is
checked against the test set as shards used in place are (data.decontaminate; SplitWriter). Large sets
are used in place instead (data.in_place, clipforge.data.inplace): a manifest, no copy.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import PurePosixPath

from clipforge.data.config import DataConfig
from clipforge.data.inputs import open_input
from clipforge.data.samples import SizeLimits, SkipLog, clean_caption, decode_image
from clipforge.data.shards import Tokenize, open_tar
from clipforge.data.splits import SplitWriter

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
PAIR_EXTENSIONS = frozenset({*IMAGE_EXTENSIONS, "txt"})  # the members read; others are passed over


def build_splits(
    data: DataConfig, out, skips: SkipLog, files: list[str], tokenize: Tokenize | None = None
) -> tuple[dict, dict]:
    """Copy the samples of `files` (data.paths expanded) into out/ (with their token ids when
    `tokenize`: data.pretokenize_model)."""
    writer = SplitWriter(out, data, tokenize)
    limits = SizeLimits.of(data)
    inputs = []
    for url in files:
        name = PurePosixPath(url).name
        read = kept = 0
        error = None
        try:
            for key, members, too_large in samples(url, limits):
                read += 1
                pair, reason = (None, too_large) if too_large else usable_pair(members, data)
                if pair is None:
                    skips.add(reason or "", f"{url}:{key}")
                    continue
                # the shard's file name, not its location: moving shards keeps the split
                writer.add(f"{name}/{key}", *pair)
                kept += 1
        except (tarfile.TarError, EOFError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            skips.add("corrupt_shard", f"{url} ({error})")
        inputs.append({"shard": url, "samples": read, "kept": kept, "error": error})
    splits = writer.close()
    source = {
        "type": "webdataset",
        "paths": list(data.paths),
        "seed": data.seed,
        "shards": inputs,
        "decontamination": writer.decontamination,  # the stage moves it to the manifest's top
    }
    return splits, source


def samples(url: str, limits: SizeLimits) -> Iterator[tuple[str, dict[str, bytes], str | None]]:
    """(key, {extension: bytes}, skip reason) per sample, streaming; raises on a damaged tar after
    yielding the samples completed before the damage. Only the members a pair is made of (an
    image, its caption) are read, and only within `limits`: a larger one is the sample's skip
    reason, passed over unread."""
    with open_input(url) as handle, open_tar(handle, "r|*") as archive:
        key: str | None = None
        members: dict[str, bytes] = {}
        too_large: str | None = None
        for info in archive:
            if not info.isfile():
                continue
            name = info.name
            directory, _, base = name.rpartition("/")
            stem, _, ext = base.partition(".")
            member_key = f"{directory}/{stem}" if directory else stem
            if member_key != key:  # the previous sample is complete before this one is read
                if key is not None:
                    yield key, members, too_large
                key, members, too_large = member_key, {}, None
            ext = ext.lower()
            if ext not in PAIR_EXTENSIONS:
                continue
            reason = limits.skip_reason(ext == "txt", info.size)
            if reason:
                too_large = too_large or reason
                continue
            members[ext] = archive.extractfile(info).read()  # type: ignore[union-attr]
        if key is not None:
            yield key, members, too_large


def usable_pair(
    members: dict[str, bytes], data: DataConfig
) -> tuple[tuple[bytes, str] | None, str | None]:
    """((jpeg, caption), None) or (None, skip reason)."""
    ext = next((e for e in IMAGE_EXTENSIONS if e in members), None)
    if ext is None:
        return None, "missing_image"
    if "txt" not in members:
        return None, "missing_caption"
    try:
        text: str | bytes = members["txt"].decode("utf-8")
    except UnicodeDecodeError:
        text = members["txt"]
    caption, reason = clean_caption(text, data.max_caption_chars)
    if caption is None:
        return None, reason
    jpeg, reason = decode_image(members[ext], data.max_image_pixels, keep_jpeg=True)
    if jpeg is None:
        return None, reason
    return (jpeg, caption), None
