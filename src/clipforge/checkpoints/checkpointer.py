"""Checkpoints in DeepSpeed's own format, one directory per run, with an atomic `latest` marker.

  checkpoints/run-<id>/step-00000100/   a DeepSpeed checkpoint (+ config.yaml, manifest.json)
  checkpoints/run-<id>/latest           the tag of the newest complete checkpoint (a hint)
  checkpoints/run-<id>/deepspeed_config.json
  checkpoints/run-<id>/sync.json        the run store's progress (clipforge.store.uploader)

(the names: clipforge.checkpoints.layout)

The run directory is named by the run id (clipforge.train.config.run_id), a fingerprint of
everything that determines the result, so re-running the stage with the same params resumes the
interrupted run, while `dvc exp run -S train.lr=...` starts a run of its own.
`latest` is replaced atomically only after every rank has finished writing and rank 0 has written
the checkpoint's manifest (sizes and sha256 of its files, clipforge.checkpoints.manifest), so a
run killed mid-save resumes from the previous checkpoint, and a start can tell an intact
checkpoint from a damaged one (clipforge.checkpoints.resume). A checkpoint the run store still
needs is not pruned.

Before each save, the free space is compared with the size of the previous checkpoint (the first
one: an estimate from the parameter count): too little stops the run with a clear error before
anything is written, little enough that the save after this one may not fit is reported (the run
raises the `disk_space_low` alert). A save that fails anyway (a disk filled by someone else, a
directory made read-only) is removed (it has no manifest yet: nothing else is ever removed but
by `prune`) and reported as such, not as torch's zip-writer error.

A checkpoint loads at another data-parallel size (a restart on the GPUs left after one fell off
the bus, or on all of them again once it is back): ZeRO's optimizer shards are per rank, so rank
0 first converts the checkpoint to DeepSpeed's universal form (`ds_to_universal`, per-parameter
fp32 weights and Adam moments) beside its files, and every rank loads that. The choice and its
cost: docs/faults.md, "Fewer GPUs, same run".
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from clipforge.checkpoints import places
from clipforge.checkpoints.disk import (
    CHECKPOINT_BYTES_PER_PARAMETER,
    DiskSpace,
    disk_space,
    tree_bytes,
    write_failure,
)
from clipforge.checkpoints.layout import (
    CHECKPOINT_MANIFEST,
    UNIVERSAL,
    data_parallel_size,
    tag_for,
    universal_partial_name,
)
from clipforge.checkpoints.manifest import write_manifest
from clipforge.errors import DiskFull

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int, is_main: bool):
        self.run_dir = run_dir
        self.keep = keep
        self.is_main = is_main
        self.storage = places.LocalStorage(run_dir)
        # A tag the run store has not taken yet is kept beyond `keep` (set by the store's sync).
        self.needed_elsewhere: Callable[[str], bool] = lambda tag: False

    def latest_tag(self) -> str | None:
        """What `latest` holds (set by the start of the run to a checkpoint that verifies)."""
        text = places.marker(self.storage)
        return None if text is None else text.strip()

    def tags(self) -> list[str]:
        return [t for t in places.tags(self.storage) if (self.run_dir / t).is_dir()]

    def publish(self, tag: str) -> None:
        places.publish(self.storage, tag)

    def set_aside(self, name: str) -> Path:
        """Rename a damaged checkpoint (or marker) out of the way, kept for inspection."""
        return Path(places.set_aside(self.storage, name))

    def save(self, engine, step: int, client_state: dict, config_yaml: str) -> DiskSpace:
        """Every rank calls this; DeepSpeed writes its shards, rank 0 then publishes the tag.
        DiskFull, on every rank alike, when the disk has no room for it (see `check_space`).
        Returns the free space found before saving."""
        space = self.check_space(engine, step)
        tag = tag_for(step)
        try:
            engine.save_checkpoint(
                str(self.run_dir), tag=tag, client_state=client_state, save_latest=False
            )
            dist.barrier()
            if self.is_main:
                (self.run_dir / tag / "config.yaml").write_text(config_yaml, encoding="utf-8")
                write_manifest(self.run_dir / tag)
                self.publish(tag)
        except Exception as exc:
            # The writer's open files live in the failed frames' locals: a removed file's blocks
            # are free only once it is closed, so the frames go first (the traceback stays).
            traceback.clear_frames(exc.__traceback__)
            gc.collect()
            if not (
                self.run_dir / tag / CHECKPOINT_MANIFEST
            ).is_file():  # a save that never finished
                shutil.rmtree(self.run_dir / tag, ignore_errors=True)
            failure = write_failure(self.run_dir, space.need, step)
            if failure is None:
                raise
            raise failure from None
        if self.is_main:
            self.prune()
        dist.barrier()
        return space

    def check_space(self, engine, step: int | None = None) -> DiskSpace:
        """Free space against the size of the latest checkpoint (the first one: an estimate);
        DiskFull on every rank when any rank lacks room, before anything is written. `step`:
        the step about to be saved (None: at the start), for the supervisor's record."""
        latest = self.latest_tag()
        if latest and (self.run_dir / latest).is_dir():
            need = tree_bytes(self.run_dir / latest)
        else:
            need = CHECKPOINT_BYTES_PER_PARAMETER * sum(
                getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()
            )
        space = disk_space(self.run_dir, need)
        full = torch.tensor([float(space.full)], device=engine.device)
        dist.all_reduce(full, op=dist.ReduceOp.MAX)  # all ranks save together, or none does
        if full.item():
            raise DiskFull(
                space.full_message()
                if space.full
                else f"another rank has no room for a checkpoint under {self.run_dir}",
                step=step,
            )
        return space

    def load(self, engine) -> dict | None:
        """Restore the newest complete checkpoint into the engine; its client state, or None.
        Saved at another data-parallel size, it is loaded through its universal form."""
        tag = self.latest_tag()
        if tag is None:
            return None
        saved_at = data_parallel_size(os.listdir(self.run_dir / tag))
        world = dist.get_world_size()
        if saved_at is None or saved_at == world:
            path, client_state = engine.load_checkpoint(str(self.run_dir), tag=tag)
        else:
            log.info(
                "%s was saved by %d data-parallel ranks, this run has %d: loading it through "
                "DeepSpeed's universal checkpoint",
                tag,
                saved_at,
                world,
            )
            if self.is_main:
                self.make_universal(tag)
            dist.barrier()
            path, client_state = _load_universal(engine, self.run_dir / tag)
        if path is None:
            raise RuntimeError(
                f"{self.run_dir / tag}: DeepSpeed could not load this checkpoint; "
                f"move the run directory away to start afresh"
            )
        return client_state

    def make_universal(self, tag: str) -> Path:
        """The universal form of checkpoint `tag` (made once: a later load reuses it), written
        aside and renamed into place, so a conversion killed half-way is never loaded."""
        checkpoint = self.run_dir / tag
        universal = checkpoint / UNIVERSAL
        if universal.is_dir():
            return universal
        partial = checkpoint / universal_partial_name()
        shutil.rmtree(partial, ignore_errors=True)
        began = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(checkpoint),
                "--output_folder",
                str(partial),
                # Our checkpoints are not Megatron's: they lack its UNIVERSAL_CHECKPOINT_INFO,
                # which a model without tensor/pipeline parallelism does not need.
                "--inject_missing_state",
                # One process each: the tool's default pools hold several copies of the
                # shards in memory; a checkpoint of our sizes converts in seconds anyway.
                "--num_extract_workers",
                "1",
                "--num_merge_workers",
                "1",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{checkpoint}: DeepSpeed's ds_to_universal failed (exit {done.returncode}):\n"
                f"{(done.stdout + done.stderr)[-3000:]}"
            )
        os.replace(partial, universal)
        log.info(
            "converted %s to its universal form in %.1f s (%.1f MB)",
            tag,
            time.monotonic() - began,
            tree_bytes(universal) / 1e6,
        )
        return universal

    def prune(self) -> None:
        for tag in self.tags()[: -self.keep]:
            if not self.needed_elsewhere(tag):
                shutil.rmtree(self.run_dir / tag, ignore_errors=True)


def _load_universal(engine, checkpoint: Path) -> tuple:
    """Load `checkpoint`'s universal form into the engine. DeepSpeed reads the choice from its
    config (`checkpoint.load_universal`), fixed when the engine was made; whether it is needed is
    known only now, from the checkpoint resumed, so it is set for this one load."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        return engine.load_checkpoint(str(checkpoint), tag=UNIVERSAL)
    finally:
        config.load_universal_checkpoint = before
