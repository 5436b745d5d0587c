"""DeepSpeed's CPU op is compiled once per environment, whatever PATH a later process has (a
stage run by DVC, by the launcher or by hand): no process finds it stale and compiles it again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env, train_argv, write_params
from tests.support.wait import wait_for

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


def _group_runs(group: int, name: str) -> bool:
    """Whether a process called `name` is in process group `group` (read from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            command = fields[0].split("(", 1)[1]
            pgrp = int(fields[1].split()[2])
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
        if pgrp == group and command == name:
            return True
    return False


@pytest.mark.tier2
def test_a_stop_while_deepspeed_compiles_its_cpu_op_ends_the_run_in_one_line(tmp_path, small_data):
    """The supervisor's stop (SIGINT to the stage's process group) while ninja compiles the op in
    a fresh extensions cache, as on a first run: the stage exits as stopped (143) with one line
    saying so and no traceback; the next process finishes the half-built op."""
    from clipforge.train.stage import EXIT_STOPPED

    cache = tmp_path / "torch_extensions"
    env = subprocess_env() | {"TORCH_EXTENSIONS_DIR": str(cache)}
    params = write_params(tmp_path / "params.yaml")
    stage = subprocess.Popen(
        [sys.executable, "-m", "clipforge.train", *train_argv(tmp_path, small_data, params)],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as under the supervisor
    )
    try:
        wait_for(
            lambda: _group_runs(stage.pid, "ninja"),
            what="ninja compiling DeepSpeed's CPU op",
            check=lambda: stage.poll() is None or pytest.fail(stage.communicate()[1][-3000:]),
        )
        os.killpg(stage.pid, signal.SIGINT)
        out, err = stage.communicate(timeout=300)
    finally:
        if stage.poll() is None:
            os.killpg(stage.pid, signal.SIGKILL)
    log = out + err
    assert stage.returncode == EXIT_STOPPED, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    stopped = [line for line in log.splitlines() if "stopped on request" in line]
    assert len(stopped) == 1 and "compilation of DeepSpeed's CPU op" in stopped[0], log[-3000:]
    finished = subprocess.run(
        [sys.executable, "-c", PREBUILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert list((cache / "deepspeed_shm_comm").glob("*.so"))
