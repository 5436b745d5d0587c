"""The Makefile as a user meets it: `make help` lists every target, and `make demo` installs only
what the demo needs."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO

MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")


def _make(*args: str) -> str:
    done = subprocess.run(
        [MAKE, "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def phony_targets() -> set[str]:
    """The targets declared .PHONY in the Makefile and every file it includes: the commands."""
    database = subprocess.run(
        [MAKE, "-pRrq", "-f", "Makefile"], cwd=REPO, capture_output=True, text=True, timeout=120
    ).stdout
    declared = re.search(r"^\.PHONY: (.*)$", database, re.MULTILINE)
    return set(declared.group(1).split())


def test_help_lists_every_target_with_what_it_does():
    """`make help` (also the default goal) names each command target of the Makefile and of the
    files it includes (infra/infra.mk, docker/docker.mk), each with its description."""
    listed = {}
    for line in _make("help").splitlines():
        name, _, description = line.removeprefix("make ").partition(" ")
        listed[name] = description.strip()
    commands = phony_targets()
    assert {"demo", "test", "up", "down", "image-push", "smoke-pinned"} <= commands
    assert set(listed) == commands
    assert all(listed.values()), listed
    assert _make() == _make("help")


def test_demo_installs_no_package_only_the_tests_need():
    """`make demo` sets up numactl (the local stack) but not openssh-server, which only the
    launcher tests use; `make test` sets that up."""
    demo = _make("-n", "-B", "demo")
    assert "scripts/setup-system.sh numactl" in demo and "openssh-server" not in demo
    assert "scripts/setup-system.sh openssh-server" in _make("-n", "-B", "test")


def test_make_up_and_down_use_the_venvs_python_outside_a_venv():
    """The Makefile's PYTHON (python3, which creates .venv) does not replace the interpreter of
    make up/down, which must have the project and Pulumi's SDK: .venv's."""
    for target in ("up", "down"):
        assert ".venv/bin/python -m clipforge_infra.stackctl" in _make("-n", target, "STACK=x")


def test_help_shows_the_image_name_expanded():
    listed = _make("help")
    assert "$(" not in listed and "clipforge:" in listed


def test_the_demo_ends_saying_how_to_activate_the_environment():
    """The demo's closing hint starts with `source .venv/bin/activate`: make's shell had the venv,
    the user's has not (`dvc` alone: command not found). One command a line, within 80 columns."""
    recipe = _make("-n", "-B", "demo")
    hint = recipe[recipe.rindex("printf ") :]  # the demo's last command
    shown = subprocess.run(["bash", "-c", hint], capture_output=True, text=True, check=True)
    lines = shown.stdout.splitlines()
    assert lines[0].endswith(": source .venv/bin/activate")
    assert [line.split()[0] for line in lines[1:]] == ["dvc", "dvc", "tensorboard"]
    assert max(map(len, lines)) <= 80, lines


def test_each_long_phase_of_the_environment_says_first_what_it_does_and_how_long(tmp_path):
    """`make env` on a fresh machine: pip runs quietly and the CPU op compiles silently for
    minutes, so each is announced by a line numbering the phase and giving its duration."""
    commands = _make("-n", "env", f"VENV={tmp_path / 'venv'}").splitlines()
    long_phases = [
        i for i, c in enumerate(commands) if " -m pip install" in c or "prebuild_cpu_ops" in c
    ]
    assert len(long_phases) == 4, commands
    for number, i in enumerate(long_phases, start=1):
        announced = commands[i - 1]
        assert announced.startswith(f'echo "[env {number}/4] '), commands[i - 1 : i + 1]
        assert re.search(r"\(.*(seconds|minutes)", announced), announced  # how long, in words


def test_the_environment_is_refused_before_its_downloads_when_the_disk_cannot_hold_it(tmp_path):
    """pip's "No space left on device" comes minutes into torch's download; `make env` asks the
    disk first and says how much it needs, how much there is and what to free."""
    commands = _make("-n", "env", f"VENV={tmp_path / 'venv'}").splitlines()
    check = next(i for i, c in enumerate(commands) if c.startswith("scripts/need-disk.sh"))
    assert check < next(i for i, c in enumerate(commands) if " -m pip install" in c)
    more_than_free = shutil.disk_usage(tmp_path).free // 2**30 + 1000

    refused = subprocess.run(
        [REPO / "scripts/need-disk.sh", str(more_than_free), tmp_path, "the venv"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1
    assert f"the venv needs about {more_than_free} GB free" in refused.stderr
    assert re.search(r"which has \d+ GB", refused.stderr) and "pip cache purge" in refused.stderr

    enough = subprocess.run([REPO / "scripts/need-disk.sh", "0", tmp_path, "the venv"])
    assert enough.returncode == 0
