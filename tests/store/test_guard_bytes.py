"""The guards of `fab clean` and `make down` compare bytes: a store checkpoint counts as kept only
when every object matches its manifest's sha256, as the resume proves a checkpoint it loads. A
same-size change (a flipped byte, a file overwritten in place) passes every size check."""

from __future__ import annotations

from pathlib import Path

from clipforge.checkpoints import places
from clipforge.checkpoints.manifest import problem, write_manifest
from clipforge.store.remote import RunStore, missing_from_store

MODEL = "mp_rank_00_model_states.pt"
BEFORE, NEWEST = "step-00000004", "step-00000008"


def _checkpoint(root: Path, tag: str) -> Path:
    folder = root / tag
    folder.mkdir(parents=True)
    (folder / MODEL).write_bytes(bytes(range(256)) * 64)
    (folder / "config.yaml").write_text("train: {}\n")
    write_manifest(folder)
    return folder


def _flip_a_byte(data: bytes) -> bytes:
    return data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]


def test_a_same_size_corrupted_store_checkpoint_is_not_kept_for_any_guard(s3, tmp_path):
    store = RunStore(f"{s3.new_bucket()}/runs", "run-0123456789ab")
    for tag in (BEFORE, NEWEST):
        store.upload_checkpoint(_checkpoint(tmp_path, tag))
        store.publish(tag)
    assert missing_from_store(store.remote, store.run_id, NEWEST) is None
    path = store.path(f"checkpoints/{NEWEST}/{MODEL}")
    store.fs.pipe_file(path, _flip_a_byte(store.fs.cat_file(path)))

    assert places.not_whole(store.checkpoints, NEWEST) is None  # the sizes cannot tell
    assert missing_from_store(store.remote, store.run_id, NEWEST) == (
        f"is not whole in the run store {store.remote} ({MODEL} does not match its sha256 in the "
        f"manifest (changed since it was saved))"
    )
    assert missing_from_store(store.remote, store.run_id, BEFORE) is None


def test_the_disk_and_the_store_are_held_to_the_one_byte_proof(s3, tmp_path):
    """The resume's check of a folder on disk and the guards' of the store say the same."""
    local = _checkpoint(tmp_path / "local", NEWEST)
    (local / MODEL).write_bytes(_flip_a_byte((local / MODEL).read_bytes()))
    disk = places.LocalStorage(local.parent)
    assert places.not_intact(disk, NEWEST) == problem(local) is not None
    assert places.not_intact(disk, NEWEST).startswith(f"{MODEL} does not match its sha256")
