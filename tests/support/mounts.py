"""Real small file systems for disk-fault tests: a tmpfs of a given size, remountable read-only.

Mounting needs root (or CAP_SYS_ADMIN); where the machine cannot mount, the test is skipped with
that reason. The mount is always undone, even when the test fails (lazily when still busy).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    try:
        result = _mount("-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path))
    except FileNotFoundError:
        pytest.skip("no `mount` command on this machine")
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, options: str) -> None:
    """e.g. `ro`, `rw`, `size=400000000` (a tmpfs can grow in place)."""
    result = _mount("-o", f"remount,{options}", str(path))
    assert result.returncode == 0, result.stderr
