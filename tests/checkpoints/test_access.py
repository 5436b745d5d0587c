"""Unreadable run state is one line: the path, its mode and owner, the remedy; exit 2, nothing
moved. Modes are enforced: root reads everything, so every check runs under `setpriv` without the
capabilities that bypass them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), as a teammate's process
would meet a run folder on shared storage."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env, train_argv, write_params

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"
)
WITHOUT_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
OTHER_UID = 54321  # no such user: a teammate
NEWEST, BEFORE = "step-00000008", "step-00000004"

# The start's first steps, as the train stage takes them: the state checked, then the lock.
_START = """
import sys
from pathlib import Path
from clipforge.checkpoints.access import check_run_state
from clipforge.checkpoints.lock import lock_run_dir
from clipforge.cli import run_stage
from clipforge.config import Params
import argparse

def body(args):
    check_run_state(Path(args.run_dir))
    lock_run_dir(Path(args.run_dir)).release()

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--print-config", action="store_true")
sys.exit(run_stage("clipforge.train", body, sys.argv[1:], parser, Params))
"""


def _run_dir(root: Path) -> Path:
    """A run folder as training leaves it: two checkpoints, `latest`, a released lock."""
    run_dir = root / "checkpoints" / "run-0123456789ab"
    for tag in (BEFORE, NEWEST):
        (run_dir / tag).mkdir(parents=True)
        (run_dir / tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")
        (run_dir / tag / "manifest.json").write_text('{"files": {}}\n')
    (run_dir / "latest").write_text(f"{NEWEST}\n")
    (run_dir / "writer.lock").write_text('{"host": "h", "pid": 1, "started_at": "t"}\n')
    return run_dir


def _tree(path: Path) -> list[tuple[str, int, int]]:
    """Every name under `path` with its mode and owner: what "nothing moved" compares."""
    found = []
    for top, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            info = os.lstat(os.path.join(top, name))
            found.append(
                (os.path.relpath(os.path.join(top, name), path), info.st_mode, info.st_uid)
            )
    return sorted(found)


def _as_teammate(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*WITHOUT_DAC, *argv], env=subprocess_env(), capture_output=True, text=True, timeout=300
    )


def _break(run_dir: Path, case: str) -> tuple[str, Path]:
    """Damage the run folder as `case` says; the words its line must say, and about which path."""
    lock, latest, newest = run_dir / "writer.lock", run_dir / "latest", run_dir / NEWEST
    if case == "step folder 000":
        newest.chmod(0)
        return "cannot list", newest
    if case == "manifest 000":
        (newest / "manifest.json").chmod(0)
        return "cannot read", newest / "manifest.json"
    if case == "latest 000":
        latest.chmod(0)
        return "cannot read", latest
    if case == "lock of another uid in a 1777 folder":
        run_dir.chmod(0o1777)
        os.chown(lock, OTHER_UID, OTHER_UID)
        lock.chmod(0o644)
        return "cannot write", lock
    if case == "run folder and lock of another uid":
        os.chown(lock, OTHER_UID, OTHER_UID)
        os.chown(run_dir, OTHER_UID, OTHER_UID)
        run_dir.chmod(0o755)
        return "cannot write into", run_dir
    if case == "lock as a folder":
        lock.unlink()
        lock.mkdir()
        return "is not a lock file", lock
    if case == "latest as a folder":
        latest.unlink()
        latest.mkdir()
        return "is not a file", latest
    assert case == "latest as a link"
    latest.unlink()
    latest.symlink_to(run_dir / BEFORE / "manifest.json")
    return "is a symbolic link", latest


CASES = [
    "step folder 000",
    "manifest 000",
    "latest 000",
    "lock of another uid in a 1777 folder",
    "run folder and lock of another uid",
    "lock as a folder",
    "latest as a folder",
    "latest as a link",
]


@pytest.mark.parametrize("case", CASES)
def test_unreadable_state_is_one_line_naming_path_mode_owner_and_remedy(tmp_path, case):
    run_dir = _run_dir(tmp_path)
    words, path = _break(run_dir, case)
    before = _tree(tmp_path)
    done = _as_teammate([sys.executable, "-c", _START, str(run_dir)])
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("clipforge.train: error: ") and words in line and str(path) in line
    if words.startswith("cannot"):  # a mode or owner: said, with who this process is
        assert "mode " in line and "owner " in line and "runs as root (uid 0)" in line
        assert "chmod" in line and "nothing was changed" in line
    else:
        assert "remove it" in line
    assert _tree(tmp_path) == before


def test_the_lock_as_another_users_file_is_said_even_past_the_check(tmp_path):
    """The lock's own writes say the same, for a file that changed after the check."""
    run_dir = _run_dir(tmp_path)
    _break(run_dir, "lock of another uid in a 1777 folder")
    code = (
        "import sys; from pathlib import Path; from clipforge.checkpoints.lock import "
        "lock_run_dir; from clipforge.errors import AccessDenied\n"
        "try: lock_run_dir(Path(sys.argv[1]))\n"
        "except AccessDenied as exc: print(exc); sys.exit(2)"
    )
    done = _as_teammate([sys.executable, "-c", code, str(run_dir)])
    assert done.returncode == 2 and done.stdout.startswith(f"cannot write {run_dir}/writer.lock")


# The whole stage (its imports, the process group, the run id: ~20 s): in make test-tier2.
@pytest.mark.tier2
def test_the_train_stage_with_an_unreadable_newest_checkpoint_says_one_line(
    tmp_path, small_data, reference_run
):
    """A real run's newest checkpoint folder at mode 000: the train stage, run without the
    capabilities that bypass modes, stops with one line and exit 2, before the model is built;
    nothing is set aside, moved or written."""
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(reference_run / "checkpoints", checkpoints)
    (run_dir,) = checkpoints.iterdir()
    newest = sorted(p for p in run_dir.iterdir() if p.name.startswith("step-"))[-1]
    newest.chmod(0)
    before = _tree(checkpoints)
    params = write_params(tmp_path / "params.yaml")
    try:
        done = _as_teammate(
            [
                sys.executable,
                "-m",
                "clipforge.train",
                *train_argv(tmp_path, small_data, params, checkpoints),
            ]
        )
        assert _tree(checkpoints) == before
    finally:
        newest.chmod(0o755)  # so that pytest can remove it
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith(f"clipforge.train: error: cannot list {newest} (mode d---------")
    assert not (tmp_path / "models").exists()
