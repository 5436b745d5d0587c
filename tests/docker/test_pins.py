"""One source of truth for the image's versions: pyproject.toml. The Dockerfile, the lock and the
image tag must agree with it; the lock must be installable piece by piece with hashes."""

from __future__ import annotations

import pytest

from tests.docker.conftest import DOCKER_DIR, REPO, load_tool

pins_mod = load_tool("pins")
lockfile = load_tool("lockfile")

PINS = pins_mod.load_pins(REPO / "pyproject.toml")
DOCKERFILE = (DOCKER_DIR / "Dockerfile").read_text(encoding="utf-8")
LOCK = (DOCKER_DIR / "requirements.lock").read_text(encoding="utf-8")
IMAGE_ENV = (DOCKER_DIR / "image.env").read_text(encoding="utf-8")


def test_dockerfile_arg_defaults_match_pyproject():
    """Base images (tag and digest), Python, CUDA, torch, torchvision, DeepSpeed, open_clip and
    the GPU architectures in the Dockerfile's ARG defaults are the ones pyproject.toml pins."""
    assert pins_mod.dockerfile_problems(PINS, DOCKERFILE) == []


def test_lock_satisfies_every_declared_requirement():
    """Every base dependency and image-extra requirement is locked at a version it allows, so
    exact pins (torch==2.1.2, deepspeed==0.14.5, open_clip_torch==3.3.0) appear exactly."""
    assert pins_mod.lock_problems(PINS, LOCK) == []


def test_headline_pins_are_locked_exactly():
    """The versions the image is named after are the locked ones (not just allowed by a range)."""
    locked = {e.name: e.version for e in lockfile.parse(LOCK)}
    for name in ("torch", "torchvision", "deepspeed", "open_clip_torch"):
        assert locked[lockfile.normalize(name)] == PINS.exact(name), name


def test_base_image_tags_encode_the_pinned_stack():
    """pytorch/pytorch:<torch>-cuda<cuda>-cudnn<cudnn>-devel|runtime, digests well-formed if set."""
    assert pins_mod.base_tag_problems(PINS) == []


def test_image_tag_names_the_pinned_stack():
    """docker/image.env's tag ends with -pt<torch>-cu<cuda>-ds<deepspeed>: a pin change needs a tag."""
    assert pins_mod.image_tag_problems(PINS, IMAGE_ENV) == []


def test_lock_check_reports_a_version_the_pyproject_does_not_allow():
    """A lock that drifted from pyproject (e.g. torch re-locked to another version) is reported."""
    drifted = LOCK.replace("\ntorch==2.1.2 ", "\ntorch==2.2.0 ")
    assert drifted != LOCK
    problems = pins_mod.lock_problems(PINS, drifted)
    assert any("torch==2.2.0" in p and "make lock" in p for p in problems), problems


def test_lock_check_reports_packages_only_a_non_image_extra_needs():
    """Launcher/infra extras (e.g. fabric) run on the user's machine: in the lock they are an error."""
    pins = pins_mod.ImagePins(**{**PINS.__dict__, "excluded_requirements": ("fabric>=3",)})
    lock = LOCK + "fabric==3.2.2 \\\n    --hash=sha256:" + "0" * 64 + "\n"
    problems = pins_mod.lock_problems(pins, lock)
    assert any("fabric" in p and "non-image extra" in p for p in problems), problems


def test_every_locked_package_has_a_sha256_hash():
    """The image installs with --require-hashes: an entry without a hash could not be installed."""
    entries = lockfile.parse(LOCK)
    assert entries and all(e.hashes for e in entries)


def test_lock_entry_without_hash_is_rejected():
    """A hand-edited entry without --hash is refused when reading the lock, naming the package."""
    with pytest.raises(ValueError, match="no --hash"):
        lockfile.parse("six==1.16.0\n    # via something\n")


def test_image_install_parts_partition_the_lock():
    """Base-image packages + the wheel pass + the DeepSpeed pass cover the lock exactly once, and
    the wheel pass never reinstalls torch or its CUDA libraries over the base image's build."""
    entries = lockfile.parse(LOCK)
    provided = lockfile.select(entries, only=list(lockfile.PROVIDED_BY_BASE_IMAGE))
    built = lockfile.select(entries, only=list(lockfile.BUILT_FROM_SOURCE))
    wheels = lockfile.select(
        entries, exclude=[*lockfile.PROVIDED_BY_BASE_IMAGE, *lockfile.BUILT_FROM_SOURCE]
    )
    names = [e.name for part in (provided, built, wheels) for e in part]
    assert sorted(names) == sorted(e.name for e in entries)
    assert {"torch", "torchvision"} <= {e.name for e in provided}
    assert not [e.name for e in wheels if e.name.startswith("nvidia-") or e.name == "torch"]


def test_dockerfile_excludes_what_the_lockfile_module_says_the_base_provides():
    """The Dockerfile's --exclude list is lockfile.py's PROVIDED_BY_BASE_IMAGE + BUILT_FROM_SOURCE."""
    line = next(
        row for row in DOCKERFILE.splitlines() if "lockfile.py requirements.lock --exclude" in row
    )
    excluded = {w.strip("'\"") for w in line.split("--exclude", 1)[1].split() if w not in ("\\",)}
    assert excluded == {*lockfile.PROVIDED_BY_BASE_IMAGE, *lockfile.BUILT_FROM_SOURCE}


def test_set_digests_rewrites_pyproject_and_dockerfile_consistently():
    """`make pin-base` writes both files; the result still passes the Dockerfile check."""
    devel, runtime = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    pyproject_text, dockerfile_text = pins_mod.with_digests(
        (REPO / "pyproject.toml").read_text(encoding="utf-8"), DOCKERFILE, PINS, devel, runtime
    )
    tmp_pins = pins_mod.ImagePins(
        **{**PINS.__dict__, "base_devel_digest": devel, "base_runtime_digest": runtime}
    )
    assert f'base_devel_digest = "{devel}"' in pyproject_text
    assert (
        pins_mod.dockerfile_args(dockerfile_text)["BASE_RUNTIME"]
        == f"{PINS.base_runtime}@{runtime}"
    )
    assert pins_mod.dockerfile_problems(tmp_pins, dockerfile_text) == []


def test_set_digests_rejects_a_malformed_digest():
    """A tag or a truncated digest is refused before either file is touched."""
    with pytest.raises(ValueError, match="not a digest"):
        pins_mod.with_digests("", DOCKERFILE, PINS, "latest", "sha256:" + "b" * 64)
