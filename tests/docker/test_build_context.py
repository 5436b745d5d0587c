"""What `.dockerignore` lets into the build context, computed with the Docker SDK's
implementation of Docker's matching rules (docker.utils.build.exclude_paths)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from docker.utils.build import exclude_paths

from tests.docker.conftest import DOCKER_DIR, REPO

# Paths that must never reach the build context, each a (directory, file inside it) example.
FORBIDDEN = [
    "data/train/shard-000000.tar",
    "checkpoints/run-0123456789ab/latest",
    "models/clip/open_clip_model.safetensors",
    "logs/run-0123456789ab/events.out",
    "metrics/train.json",
    ".venv/bin/python",
    ".venv-pinned/bin/python",
    ".git/objects/ab/cdef",
    ".dvc/cache/files/md5/ab/cdef",
    "src/clipforge/__pycache__/cli.cpython-311.pyc",
]
MAX_CONTEXT_BYTES = 5 * 1024 * 1024


def context_files(root: Path) -> set[str]:
    patterns = (root / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return {p for p in exclude_paths(str(root), patterns) if (root / p).is_file()}


def copy_sources(dockerfile: str) -> list[str]:
    """Source paths of the Dockerfile's COPY instructions that read the build context."""
    text = re.sub(r"\\\n", " ", dockerfile)
    sources = []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0] != "COPY" or any(w.startswith("--from") for w in words):
            continue
        sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


@pytest.fixture
def project_with_outputs(tmp_path) -> Path:
    """A copy of the project's sources plus every kind of output a real checkout accumulates."""
    for name in (".dockerignore", "pyproject.toml", "params.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(
        REPO / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    shutil.copytree(DOCKER_DIR, tmp_path / "docker")
    for relative in FORBIDDEN:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1024)
    return tmp_path


def test_outputs_environments_and_git_stay_out_of_the_context(project_with_outputs):
    """data, checkpoints, models, logs, metrics, .venv*, .git, .dvc/cache and bytecode are excluded."""
    let_through = context_files(project_with_outputs)
    assert [p for p in FORBIDDEN if p in let_through] == []
    assert not [
        p
        for p in let_through
        if p.split("/")[0] in {"data", "checkpoints", "models", "logs", "metrics", ".git", ".dvc"}
        or p.startswith(".venv")
    ]


def test_the_package_named_data_inside_src_is_not_mistaken_for_data(project_with_outputs):
    """Root-anchored patterns: src/clipforge/data/ (code) is sent although /data is not."""
    assert "src/clipforge/data/stage.py" in context_files(project_with_outputs)


def test_every_file_the_dockerfile_copies_is_in_the_context():
    """The allow-list lets through everything the Dockerfile's COPY instructions read."""
    let_through = context_files(REPO)
    sources = copy_sources((DOCKER_DIR / "Dockerfile").read_text(encoding="utf-8"))
    assert sources, "no COPY found: the parser no longer matches the Dockerfile"
    missing = [
        s
        for s in sources
        if not any(p == s or p.startswith(s.rstrip("/") + "/") for p in let_through)
    ]
    assert missing == []


def test_context_of_this_checkout_is_small():
    """The real checkout's context stays under 5 MiB, whatever outputs lie around in it."""
    total = sum((REPO / p).stat().st_size for p in context_files(REPO))
    assert total < MAX_CONTEXT_BYTES, f"build context is {total / 2**20:.1f} MiB"
