"""The environment record (clipforge.envrecord): what it reads, and its round trip."""

from __future__ import annotations

import hashlib
import platform
import sys
from importlib import metadata
from pathlib import Path

from clipforge import envrecord
from tests.conftest import git


def test_versions_are_the_installed_ones_read_by_importlib_metadata():
    stack = envrecord.gather("test").stack
    assert stack.python == platform.python_version()
    assert stack.deepspeed == metadata.version("deepspeed")
    assert stack.open_clip == metadata.version("open_clip_torch")
    assert stack.transformers == metadata.version("transformers")
    assert stack.torch is not None and stack.torch.startswith(metadata.version("torch"))
    # the installed packages, not the copies a package vendors (on sys.path once it is imported)
    paths = [p for p in sys.path if "_vendor" not in Path(p).parts]
    installed = {d.metadata["Name"].lower() for d in metadata.distributions(path=paths)}
    assert stack.num_packages == len(installed)


def test_params_and_manifest_are_hashed_and_the_plan_kept(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_bytes(b'{"shards": []}')
    record = envrecord.gather(
        "test", params_text="train:\n  seed: 3\n", data_manifest=manifest, plan={"seed": 3}
    )
    assert record.params_sha256 == hashlib.sha256(b"train:\n  seed: 3\n").hexdigest()
    assert record.data_manifest_sha256 == hashlib.sha256(b'{"shards": []}').hexdigest()
    assert record.plan == {"seed": 3}


def test_a_dirty_tree_is_marked_with_the_hash_of_its_diff(tmp_path):
    git(tmp_path, "init", "--quiet")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "--quiet", "-m", "one")
    clean = envrecord.code_at(str(tmp_path))
    assert clean.commit == git(tmp_path, "rev-parse", "HEAD").strip()
    assert clean.dirty is False and clean.diff_sha256 is None
    (tmp_path / "a.py").write_text("x = 2\n")
    dirty = envrecord.code_at(str(tmp_path))
    assert dirty.dirty is True and dirty.diff_sha256
    (tmp_path / "a.py").write_text("x = 3\n")
    assert envrecord.code_at(str(tmp_path)).diff_sha256 != dirty.diff_sha256


def test_outside_a_checkout_the_commit_is_unknown(tmp_path):
    assert envrecord.code_at(str(tmp_path)).commit is None


def test_the_image_digest_comes_from_the_reference_or_the_environment():
    ref = "registry/clipforge@sha256:" + "a" * 64
    runtime = envrecord.gather("test", environ={envrecord.IMAGE_ENV: ref}).runtime
    assert runtime.image == ref and runtime.image_digest == "sha256:" + "a" * 64
    tagged = envrecord.gather(
        "test",
        environ={envrecord.IMAGE_ENV: "clipforge:1", envrecord.IMAGE_DIGEST_ENV: "sha256:b"},
    ).runtime
    assert tagged.image_digest == "sha256:b"
    assert envrecord.gather("test", environ={}).runtime.image is None


def test_the_record_reads_back_as_written():
    record = envrecord.gather("test", params_text="x", plan={"world_size": 2})
    assert envrecord.from_dict(record.to_dict()) == record


def test_the_card_lines_name_the_stack_and_the_data():
    record = envrecord.gather("test", params_text="x").to_dict()
    text = "\n".join(envrecord.card_lines(record))
    assert f"DeepSpeed {metadata.version('deepspeed')}" in text
    assert record["stack"]["packages_sha256"] in text


def test_the_package_list_does_not_change_when_setuptools_adds_its_vendored_copies(monkeypatch):
    """setuptools appends its `_vendor` folder to sys.path once imported (mid-run, by DeepSpeed's
    op builder): the list read after that is the one read before (fab rerun compares the two)."""
    import setuptools

    vendor = Path(setuptools.__file__).parent / "_vendor"
    assert any(vendor.glob("*.dist-info")), "this setuptools vendors no distributions"
    before = envrecord.installed_versions()
    monkeypatch.syspath_prepend(str(vendor))
    assert envrecord.installed_versions() == before
