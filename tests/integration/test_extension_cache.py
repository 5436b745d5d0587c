"""DeepSpeed's CPU op is compiled once per environment, whatever PATH a later process has (a
stage run by DVC, by the launcher or by hand): no process finds it stale and compiles it again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import subprocess_env

PREBUILD = (
    "from clipforge.train.dist import prebuild_cpu_ops; prebuild_cpu_ops(); "
    "import os; print(os.environ['TORCH_EXTENSIONS_DIR'])"
)


def _prebuild(path: str) -> Path:
    env = subprocess_env() | {"PATH": path, "DS_ACCELERATOR": "cpu"}
    env.pop("TORCH_EXTENSIONS_DIR", None)
    result = subprocess.run(
        [sys.executable, "-c", PREBUILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return Path(result.stdout.strip().splitlines()[-1]) / "deepspeed_shm_comm"


def test_a_process_with_the_system_ninja_first_on_path_does_not_rebuild_the_op():
    venv_first = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    build_dir = _prebuild(venv_first)  # builds it only if this environment never did
    built = {p.name: p.stat().st_mtime_ns for p in build_dir.glob("*.so")}
    assert built, f"no compiled op in {build_dir}"
    _prebuild("/usr/local/bin:/usr/bin:/bin")  # e.g. Debian's ninja-build, another version
    assert {p.name: p.stat().st_mtime_ns for p in build_dir.glob("*.so")} == built
