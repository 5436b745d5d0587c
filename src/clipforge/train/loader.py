"""Training data as a pure function of the step: what makes resume exact and cheap.

Which sample sits at each position of each epoch is clipforge.train.order's (EpochOrder,
MixtureOrder). Optimizer step s of the epoch uses positions [s*G, (s+1)*G) of that sequence
(G = global batch); rank r's micro-batch j of the step takes the slice starting at
s*G + (j*W + r)*m (W ranks, micro batch m). Random augmentation is seeded per sample from
(seed, epoch, position).

So micro-batch number i of a rank is computable from i alone: a resumed run starts its
DataLoader at the checkpoint's position and sees exactly the batches the interrupted run would
have seen, whatever the number of loader workers, without reading the skipped samples.

Shards used in place (data.in_place) are read through the same (shard, index) addressing, at the
offsets the data stage indexed (clipforge.data.shards.InPlaceReader); a sample whose image does
not decode there is replaced by the next position's and counted (`Batches.skipped`).

Token ids come from data/ where the data stage stored them (data.pretokenize_model) and its
record of the tokenizer matches the model's (`stored_tokens`); the workers then read ids instead
of tokenising captions. Otherwise, and for data without ids, they tokenise as they go.

The loader's unit of work is a chunk of at most CHUNK_SAMPLES samples of one micro-batch, so a
micro-batch is decoded by many workers at once. Workers emit uint8 pixels; the cast and the
normalisation happen on the device (`DeviceBatches`), which moves a quarter of fp32's bytes
through shared memory, pinned memory and the PCIe link.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import cast

import numpy as np
import torch
from PIL import Image

from clipforge import util
from clipforge.data.samples import SkipLog
from clipforge.data.shards import (
    TOKENS_MEMBER,
    InPlaceReader,
    ShardReader,
    TokenFormat,
    check_unchanged,
)
from clipforge.fields import ConfigError
from clipforge.model.config import ModelConfig
from clipforge.train.config import BatchPlan
from clipforge.train.order import EpochOrder, MixtureOrder, sample_seed

log = logging.getLogger("clipforge.train")


@dataclass(frozen=True)
class SplitFiles:
    paths: list[Path]
    counts: list[int]
    # A split used in place (clipforge.data.inplace): the manifest's entries of its shards; `paths`
    # are then their index files.
    in_place: list[dict] | None = None
    # A mixture (clipforge.data.mixture): each source's own files, whose shards these are one
    # source after the other; in the train split, each source's weight (MixtureOrder draws by them).
    parts: tuple[SplitFiles, ...] = ()
    weights: tuple[float, ...] = ()

    @property
    def num_samples(self) -> int:
        return sum(self.counts)

    def shard_name(self, shard: int) -> str:
        if self.parts:
            part, shard = self.part_of(shard)
            return self.parts[part].shard_name(shard)
        return self.in_place[shard]["url"] if self.in_place else self.paths[shard].name

    def reader(self, max_open_files: int = 16) -> SampleReader:
        """Random access by (shard, index): to data/'s shards, or to the original ones."""
        if self.parts:
            return PartsReader(self, [part.reader(max_open_files) for part in self.parts])
        if self.in_place is not None:
            return InPlaceReader(self.paths, self.in_place, max_open_files)
        return ShardReader(self.paths, max_open_files=max_open_files)

    def order(self, seed: int, window_shards: int) -> EpochOrder | MixtureOrder:
        """Which sample sits at each position of each epoch: every sample once an epoch, or, in a
        weighted mixture, each position's source drawn by weight (MixtureOrder)."""
        if self.weights:
            counts = [part.counts for part in self.parts]
            return MixtureOrder(counts, list(self.weights), seed, window_shards)
        return EpochOrder(self.counts, seed, window_shards)

    def part_of(self, shard: int) -> tuple[int, int]:
        """A mixture's shard number -> (its source, its number among that source's shards)."""
        part = bisect.bisect_right(self._first_shards, shard) - 1
        return part, shard - self._first_shards[part]

    @cached_property
    def _first_shards(self) -> list[int]:
        return np.cumsum([0] + [len(part.counts) for part in self.parts]).tolist()


class PartsReader:
    """The readers of a mixture's sources as one, by the shard numbers of their concatenation."""

    def __init__(self, files: SplitFiles, readers: list[SampleReader]):
        self.files = files
        self.readers = readers

    def read(self, shard: int, index: int) -> dict[str, bytes]:
        part, shard = self.files.part_of(shard)
        return self.readers[part].read(shard, index)


SampleReader = ShardReader | InPlaceReader | PartsReader  # (shard, index) -> the sample's members


def split_files(data_dir: Path, split: str) -> SplitFiles:
    """Shards of a split and their sample counts, from data/manifest.json. Shards used in place
    are checked against the manifest first (ShardChangedError names one that changed)."""
    manifest = json.loads((data_dir / "manifest.json").read_text(encoding="utf-8"))
    entry = manifest["splits"][split]
    if "mixture" in entry:
        return _mixture_files(data_dir, entry)
    return _files(data_dir, entry["shards"], bool(entry.get("in_place")))


def _files(data_dir: Path, shards: list[dict], in_place: bool) -> SplitFiles:
    paths = [data_dir / s["name"] for s in shards]
    counts = [int(s["count"]) for s in shards]
    if not in_place:
        return SplitFiles(paths, counts)
    check_unchanged(shards)
    return SplitFiles(paths, counts, in_place=shards)


def _mixture_files(data_dir: Path, entry: dict) -> SplitFiles:
    """A mixture's split: each source's shards (the manifest lists them one source after the
    other, `mixture` says how many each), copied or in place, as one SplitFiles."""
    parts, begin = [], 0
    for source in entry["mixture"]:
        shards = entry["shards"][begin : begin + int(source["num_shards"])]
        parts.append(_files(data_dir, shards, bool(source["in_place"])))
        begin += len(shards)
    weighted = all("weight" in source for source in entry["mixture"])
    return SplitFiles(
        paths=[path for part in parts for path in part.paths],
        counts=[count for part in parts for count in part.counts],
        parts=tuple(parts),
        weights=tuple(float(s["weight"]) for s in entry["mixture"]) if weighted else (),
    )


# Samples of the first train shard whose stored ids are compared with the tokenizer's own before
# any are used: a last check behind the fingerprint, for the price of a few reads.
SPOT_CHECK_SAMPLES = 16


def stored_tokens(
    data_dir: Path, files: SplitFiles, tokenizer: Callable, model: ModelConfig
) -> TokenFormat | None:
    """How data/'s stored token ids read, when they are what `tokenizer` (`model`'s) gives: its
    fingerprint is the one the manifest records, and the first samples' ids are its output for
    their captions. None otherwise (the loader tokenises), with one line saying why and what to
    do about it."""
    from clipforge.model.names import fingerprint_difference, tokenizer_fingerprint

    manifest = json.loads((data_dir / "manifest.json").read_text(encoding="utf-8"))
    entry = manifest.get("tokens")
    if entry is None:
        log.info(
            "the loader tokenises the captions: data/ holds no token ids (data.pretokenize_model)"
        )
        return None
    stored_by = entry["tokenizer"].get("text_tower") or entry["tokenizer"].get("model")
    ours = model.text_tower or model.name
    why = fingerprint_difference(entry["tokenizer"], tokenizer_fingerprint(tokenizer))
    if why is not None:
        # The usual cause: a new model.name, which (by design) leaves data/ as it is.
        log.warning(
            "the loader tokenises the captions: data/'s token ids are of %s's tokenizer, not this "
            "model's (%s: %s); set data.pretokenize_model: %s and data.pretokenize_text_tower: %s "
            "to store its ids, or leave them: they are then just not used",
            stored_by,
            ours,
            why,
            model.name,
            model.text_tower or "null",
        )
        return None
    token_format = TokenFormat(entry["dtype"], int(entry["context_length"]))
    why = _spot_check(files, tokenizer, token_format) if files.num_samples else None
    if why is not None:
        log.warning(
            "the loader tokenises the captions: data/'s token ids are not %s's tokenizer's output "
            "although its fingerprint matches (%s); rerun the data stage (dvc repro --force data)",
            ours,
            why,
        )
        return None
    log.info("token ids: read from data/ (%s's tokenizer, stored by the data stage)", stored_by)
    return token_format


def _spot_check(files: SplitFiles, tokenizer: Callable, token_format: TokenFormat) -> str | None:
    reader = files.reader(max_open_files=1)
    samples = [reader.read(0, i) for i in range(min(SPOT_CHECK_SAMPLES, files.counts[0]))]
    if any(TOKENS_MEMBER not in sample for sample in samples):
        return f"the first shard's samples have no {TOKENS_MEMBER} member"
    stored = token_format.decode([sample[TOKENS_MEMBER] for sample in samples])
    made = np.asarray(tokenizer([sample["txt"].decode("utf-8") for sample in samples]))
    if stored.shape != made.shape or not np.array_equal(stored, made):
        return "the first shard's stored ids differ from its own for the same captions"
    return None


CHUNK_SAMPLES = 64  # the loader's unit of work: small enough to spread a micro-batch over workers


def chunk_bounds(micro_batch_size: int) -> list[tuple[int, int]]:
    """(start, stop) of each chunk of a micro-batch: as many as needed, as even as possible."""
    num = -(-micro_batch_size // CHUNK_SAMPLES)
    edges = [round(i * micro_batch_size / num) for i in range(num + 1)]
    return list(zip(edges[:-1], edges[1:]))


class MicroBatches(torch.utils.data.Dataset):
    """Item i = chunk i of this rank's micro-batches, in order: (uint8 images, token ids).
    Micro-batch number n is items [n*C, (n+1)*C), C = `chunks_per_micro_batch`."""

    def __init__(
        self,
        files: SplitFiles,
        plan: BatchPlan,
        rank: int,
        seed: int,
        total_steps: int,
        transform: Callable,
        tokenizer: Callable,
        window_shards: int,
        tokens: TokenFormat | None = None,
    ):
        self.files = files
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.total_steps = total_steps
        self.transform = transform
        self.tokenizer = tokenizer
        self.tokens = tokens  # stored ids to read (stored_tokens); None: tokenise the captions
        self.window_shards = window_shards
        self.order = files.order(seed, window_shards)
        self.steps_per_epoch = util.steps_per_epoch(files.num_samples, plan.global_batch_size)
        self.chunks = chunk_bounds(plan.micro_batch_size)
        self._reader: SampleReader | None = None  # lazily, once per worker

    @property
    def chunks_per_micro_batch(self) -> int:
        return len(self.chunks)

    def __len__(self) -> int:
        return self.total_steps * self.plan.grad_accum_steps * self.chunks_per_micro_batch

    def positions(self, micro_batch: int) -> tuple[int, range]:
        """(epoch, positions in the epoch) of micro-batch number `micro_batch` of this rank."""
        step, j = divmod(micro_batch, self.plan.grad_accum_steps)
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        m, world = self.plan.micro_batch_size, self.plan.world_size
        start = step_in_epoch * self.plan.global_batch_size + (j * world + self.rank) * m
        return epoch, range(start, start + m)

    def __getitem__(
        self, index: int
    ) -> tuple[
        torch.Tensor | tuple[list[torch.Tensor], torch.Tensor], torch.Tensor, list[tuple[str, str]]
    ]:
        """(uint8 images, token ids, skipped samples as (reason, where)); the images are
        (the JPEGs, their crop boxes) when the device decodes them (DeviceCrop)."""
        if self._reader is None:  # the open files of one window of shards
            self._reader = self.files.reader(max_open_files=self.window_shards)
        micro_batch, chunk = divmod(index, self.chunks_per_micro_batch)
        epoch, positions = self.positions(micro_batch)
        images, captions, jpegs, stored = [], [], [], []
        skipped: list[tuple[str, str]] = []
        keeps_jpeg = isinstance(self.transform, DeviceCrop)
        for position in positions[slice(*self.chunks[chunk])]:
            image, caption, sample = self._sample(epoch, position, skipped)
            images.append(image)
            captions.append(caption)
            if self.tokens is not None:
                stored.append(sample[TOKENS_MEMBER])
            if keeps_jpeg:
                jpegs.append(torch.frombuffer(bytearray(sample["jpg"]), dtype=torch.uint8))
        if self.tokens is not None:  # the tokenizer's output, as the data stage stored it
            tokens = torch.from_numpy(self.tokens.decode(stored))
        else:
            tokens = self.tokenizer(captions)
        if keeps_jpeg:  # (the JPEGs, their crop boxes): decoded by DeviceBatches
            return (jpegs, torch.stack(images)), tokens, skipped
        return torch.stack(images), tokens, skipped

    def _sample(
        self, epoch: int, position: int, skipped: list[tuple[str, str]]
    ) -> tuple[torch.Tensor, str, dict[str, bytes]]:
        """The sample at `position` (its transformed image, caption and members); one that does
        not decode (a corrupt JPEG in a shard used in place, verified by sampling only) is
        replaced by the next position's, so the batch keeps its size and the data order stays a
        function of the step alone."""
        assert self._reader is not None  # opened by __getitem__, the only caller
        for attempt in range(MAX_REPLACEMENTS + 1):
            shard, index = self.order.locate(epoch, (position + attempt) % self.files.num_samples)
            sample = self._reader.read(shard, index)
            try:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(sample_seed(self.seed, epoch, position))
                    image = self.transform(Image.open(io.BytesIO(sample["jpg"])))
                return image, sample["txt"].decode("utf-8"), sample
            except (OSError, SyntaxError, ValueError, UnicodeDecodeError) as exc:
                # PIL: OSError (truncated, unidentified), SyntaxError (bad PNG), ValueError
                reason = (
                    "caption_not_utf8" if isinstance(exc, UnicodeDecodeError) else "corrupt_image"
                )
                skipped.append((reason, f"{self.files.shard_name(shard)}#{index}"))
        raise RuntimeError(f"{MAX_REPLACEMENTS + 1} consecutive samples do not decode")


# A run of this many unreadable samples in a row is no bad JPEG but unreadable data: a bug to see.
MAX_REPLACEMENTS = 64


def uint8_transform(preprocess: Callable) -> tuple[Callable, list[float], list[float]]:
    """open_clip's preprocessing up to the pixels, ending in uint8 instead of normalised floats;
    and the normalisation's mean and std, applied later on the device."""
    from torchvision import transforms

    steps = preprocess.transforms  # type: ignore[attr-defined]  # open_clip's is a Compose
    (normalize,) = [t for t in steps if isinstance(t, transforms.Normalize)]
    kept = [t for t in steps if type(t).__name__ not in ("ToTensor", "MaybeToTensor", "Normalize")]
    return (
        transforms.Compose([*kept, transforms.PILToTensor()]),
        list(normalize.mean),
        list(normalize.std),
    )


class DeviceCrop:
    """The loader workers' half of train.decode_on_device: the crop box of open_clip's
    RandomResizedCrop, drawn exactly as it draws it (same generator calls, so the same box as the
    CPU path for the same sample), from the JPEG's header alone: PIL decodes no pixel for
    `.size`. The JPEG itself is decoded, cropped and resized on the GPU (`DeviceBatches`)."""

    def __init__(self, crop):
        self.size = crop.size[0] if isinstance(crop.size, (tuple, list)) else crop.size
        self.scale = crop.scale
        self.ratio = crop.ratio
        self.interpolation = crop.interpolation

    def __call__(self, image: Image.Image) -> torch.Tensor:
        from torchvision import transforms

        top, left, height, width = transforms.RandomResizedCrop.get_params(
            image, self.scale, self.ratio
        )
        return torch.tensor([top, left, height, width])


def device_decode_transform(preprocess: Callable) -> tuple[DeviceCrop, list[float], list[float]]:
    """uint8_transform's counterpart for train.decode_on_device: the workers draw the crop, the
    device does the rest. Only open_clip's default training transform (random resized crop, RGB,
    to tensor, normalise) is supported; anything else is a config error naming it."""
    from torchvision import transforms

    steps = cast(transforms.Compose, preprocess).transforms  # open_clip's is a Compose
    (normalize,) = [t for t in steps if isinstance(t, transforms.Normalize)]
    plain = ("ToTensor", "MaybeToTensor", "Normalize", "MaybeConvertMode", "function")
    crops = [t for t in steps if isinstance(t, transforms.RandomResizedCrop)]
    others = [type(t).__name__ for t in steps if type(t).__name__ not in plain and t not in crops]
    if len(crops) != 1 or others:
        raise ConfigError(
            f"train.decode_on_device: supports open_clip's default training transform (a random "
            f"resized crop) only; this model's has {others or 'no random resized crop'}"
        )
    return DeviceCrop(crops[0]), list(normalize.mean), list(normalize.std)


def check_decode_on_device(device: str) -> None:
    """train.decode_on_device needs a GPU: nvjpeg has no CPU counterpart worth having (the
    workers decode faster there)."""
    if device != "cuda":
        raise ConfigError(
            f"train.decode_on_device: needs a CUDA device, and the run's is {device!r}; set it "
            f"to false (the loader workers then decode)"
        )


class DeviceBatches:
    """Chunks of uint8 pixels -> a micro-batch on the device, normalised as torchvision's
    ToTensor + Normalize would (the same operations, in the same order), cast to `dtype`.

    On a GPU the host-to-device copies run on a side stream: queued on the compute stream they
    would wait behind the previous step's backward and optimizer step, which the host has not
    waited for; on their own stream they overlap with it. The compute stream waits for the copy
    only where it uses the batch. On CPU there is no stream and the same code copies nothing."""

    def __init__(
        self,
        mean,
        std,
        device: torch.device,
        dtype: torch.dtype,
        decode: DeviceCrop | None = None,
    ):
        self.mean = torch.tensor(mean, device=device).view(-1, 1, 1)
        self.std = torch.tensor(std, device=device).view(-1, 1, 1)
        self.device = device
        self.dtype = dtype
        self.decode = decode  # train.decode_on_device: chunks of JPEGs and crop boxes
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, chunks: list[tuple[torch.Tensor, torch.Tensor]]):
        if isinstance(chunks[0][0], tuple):  # (JPEGs, crop boxes) from DeviceCrop's workers
            jpegs = [jpeg for c in chunks for jpeg in c[0][0]]
            boxes = torch.cat([c[0][1] for c in chunks]).tolist()
            images = decode_crop_resize(jpegs, boxes, self.decode, self.device)
            texts = torch.cat([c[1] for c in chunks]).to(self.device, non_blocking=True)
            return self._normalise(images), texts
        with _on_stream(self.copy_stream):
            images = torch.cat([c[0].to(self.device, non_blocking=True) for c in chunks])
            texts = torch.cat([c[1].to(self.device, non_blocking=True) for c in chunks])
        if self.copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            # made on the copy stream, used on the compute stream: not to be reused before that
            images.record_stream(compute)
            texts.record_stream(compute)
        return self._normalise(images), texts

    def _normalise(self, images: torch.Tensor) -> torch.Tensor:
        images = images.float().div_(255).sub_(self.mean).div_(self.std)
        return images.to(self.dtype)


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def decode_resize_on_device(
    encoded: list[torch.Tensor], size: int, device: torch.device
) -> torch.Tensor:
    """JPEG bytes (1-d uint8 tensors) -> uint8 images [N, 3, size, size] on `device`: decoded in
    one batched call (nvjpeg on a GPU), then on the device each shorter side resized to `size`
    and the centre cropped, as open_clip's validation transform does."""
    from torchvision.io import ImageReadMode, decode_jpeg

    # Imported by name: `import torchvision` does not import transforms.v2 (an AttributeError
    # on torchvision 0.26 otherwise).
    from torchvision.transforms.v2 import functional as tvf

    decoded = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    return torch.stack(
        [
            tvf.center_crop(tvf.resize(image, [size], antialias=True), [size, size])
            for image in decoded
        ]
    )


def decode_crop_resize(
    jpegs: list[torch.Tensor], boxes: list[list[int]], crop: DeviceCrop, device: torch.device
) -> torch.Tensor:
    """JPEGs decoded in one batched call on `device`, each cut to its box (top, left, height,
    width) and resized to the crop's size with its interpolation, as RandomResizedCrop does on
    the CPU; uint8 [N, 3, size, size]."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as tvf

    decoded = decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device)
    size = [crop.size, crop.size]
    return torch.stack(
        [
            tvf.resized_crop(image, *box, size, interpolation=crop.interpolation, antialias=True)
            for image, box in zip(decoded, boxes)
        ]
    )


def grouped(chunks: Iterator, size: int) -> Iterator[list]:
    """The loader's chunks, `size` at a time: one micro-batch's worth each."""
    while True:
        group = list(itertools.islice(chunks, size))
        if not group:
            return
        yield group


class Batches:
    """An iterator of micro-batches as lists of (images, token ids) chunks; `skipped` counts the
    samples the loaders replaced (by reason), as this process received them."""

    def __init__(self, loader, per_micro_batch: int):
        self.loader = loader
        self.per_micro_batch = per_micro_batch
        self.skipped = SkipLog()
        self._groups: Iterator[list] | None = None

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> list:
        if self._groups is None:
            self._groups = grouped(self._chunks(), self.per_micro_batch)
        return next(self._groups)

    def _chunks(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, tokens, skipped in self.loader:
            for reason, where in skipped:
                self.skipped.add(reason, where)
            yield images, tokens


def micro_batch_loader(
    dataset: MicroBatches, start: int, num_workers: int, pin_memory: bool, prefetch_factor: int
) -> Batches:
    """Micro-batches start, start + 1, ... in order, as lists of chunks prepared by worker
    processes (each chunk by one worker, the chunks of a micro-batch by several)."""
    per_micro_batch = dataset.chunks_per_micro_batch
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        sampler=range(start * per_micro_batch, len(dataset)),
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=False,
    )
    return Batches(loader, per_micro_batch)


SHM_SHARE = 0.5  # of /dev/shm's free space the loaders of one node may fill
MAX_PREFETCH = 4


def prefetch_factor(
    chunk_bytes: int, num_workers: int, ranks_per_node: int, free_bytes: int
) -> int:
    """Chunks each worker may hold ready in shared memory: up to MAX_PREFETCH, as many as the
    node's /dev/shm share allows. Raises ConfigError when not even one fits."""
    if num_workers == 0:
        return MAX_PREFETCH  # no worker processes: nothing goes through shared memory
    per_prefetch = chunk_bytes * num_workers * ranks_per_node
    fits = int(free_bytes * SHM_SHARE // per_prefetch)
    if fits < 1:
        raise ConfigError(
            f"/dev/shm has {free_bytes / 2**20:.0f} MiB free, but the loaders need "
            f"{per_prefetch / 2**20:.0f} MiB ({ranks_per_node} ranks x {num_workers} workers x "
            f"{chunk_bytes / 2**20:.1f} MiB per chunk) and may use {SHM_SHARE:.0%} of it; lower "
            f"train.num_workers or enlarge /dev/shm (docker run --shm-size, or a memory-backed "
            f"emptyDir on Kubernetes)"
        )
    return min(MAX_PREFETCH, fits)


def chunk_bytes(image_size: int, context_length: int) -> int:
    """Shared-memory bytes of one loader chunk: uint8 pixels and int64 token ids."""
    return CHUNK_SAMPLES * (3 * image_size * image_size + 8 * context_length)
