"""The teardown guard on real directories standing for scratch disk, the retained volume and a DVC
remote (a real DVC repository with a local remote, pushed with the real `dvc push`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from infra_harness import INFRA_DIR  # noqa: F401  (puts infra/ on sys.path)

from clipforge_infra import teardown_guard
from clipforge_infra.teardown_guard import (
    EXIT_REFUSED,
    ListedDvcRemote,
    LocalDvcRemote,
    assess,
    find_latest_checkpoint,
)

DVC = Path(sys.executable).with_name("dvc")
needs_dvc = pytest.mark.skipif(
    not DVC.exists(), reason="dvc is not installed next to this Python (pyproject extra `infra`)"
)


def write_checkpoint(checkpoints: Path, run: str, step: int, mtime: float | None = None) -> Path:
    """A checkpoint in the train stage's layout: run-<hex>/step-N/ files, then `latest` naming it."""
    tag = f"step-{step:08d}"
    tag_dir = checkpoints / run / tag
    (tag_dir / "global_step").mkdir(parents=True)
    (tag_dir / "global_step" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(2048))
    (tag_dir / "zero_to_fp32.py").write_text(f"# step {step}\n")
    (checkpoints / run / "latest").write_text(tag)
    if mtime is not None:
        os.utime(checkpoints / run, (mtime, mtime))
    return tag_dir


def guard(*args: str) -> int:
    return teardown_guard.main(list(args))


def test_refuses_when_the_latest_checkpoint_is_only_on_scratch_disk(tmp_path, capsys):
    """A checkpoint on a non-retained directory with no DVC remote makes the guard refuse."""
    write_checkpoint(tmp_path / "scratch", "run-0123456789ab", 100)
    code = guard(
        "--checkpoints",
        str(tmp_path / "scratch"),
        "--retained",
        str(tmp_path / "volume"),
        "--dvc-repo",
        str(tmp_path),
    )
    assert code == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "refusing" in err and "run-0123456789ab/step-00000100" in err and "FORCE=1" in err


def test_force_proceeds_despite_an_unsafe_checkpoint(tmp_path, capsys):
    """--force (FORCE=1) exits 0 and still warns what may be lost."""
    write_checkpoint(tmp_path / "scratch", "run-0123456789ab", 100)
    code = guard(
        "--checkpoints",
        str(tmp_path / "scratch"),
        "--retained",
        str(tmp_path / "volume"),
        "--dvc-repo",
        str(tmp_path),
        "--force",
    )
    assert code == 0
    assert "releasing anyway" in capsys.readouterr().err


def test_checkpoint_on_retained_volume_through_a_symlink_is_safe(tmp_path, capsys):
    """checkpoints/ linked into the retained volume counts as retained (the real path is checked)."""
    volume = tmp_path / "volume"
    write_checkpoint(volume, "run-0123456789ab", 200)
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "checkpoints").symlink_to(volume)
    code = guard(
        "--checkpoints",
        str(tmp_path / "repo" / "checkpoints"),
        "--retained",
        str(volume),
        "--dvc-repo",
        str(tmp_path / "repo"),
    )
    assert code == 0
    assert "retained storage" in capsys.readouterr().out


def test_no_checkpoint_means_nothing_to_lose(tmp_path):
    """An absent or empty checkpoints directory lets the release go ahead."""
    assert guard("--checkpoints", str(tmp_path / "absent"), "--dvc-repo", str(tmp_path)) == 0


def test_latest_run_is_the_most_recently_modified_one(tmp_path):
    """Of two runs, the guard judges the one modified last, whatever the names sort to."""
    checkpoints = tmp_path / "checkpoints"
    write_checkpoint(checkpoints, "run-ffffffffffff", 100, mtime=1_000_000)
    write_checkpoint(checkpoints, "run-000000000000", 300, mtime=2_000_000)
    (checkpoints / "run-aaaaaaaaaaaa").mkdir()  # no `latest`: an aborted run, ignored
    latest = find_latest_checkpoint(checkpoints)
    assert (latest.run_dir.name, latest.tag) == ("run-000000000000", "step-00000300")


def test_latest_naming_a_missing_tag_is_refused(tmp_path):
    """`latest` pointing at a tag directory that does not exist is not a safe checkpoint."""
    checkpoints = tmp_path / "checkpoints"
    write_checkpoint(checkpoints, "run-0123456789ab", 100)
    (checkpoints / "run-0123456789ab" / "latest").write_text("step-00000200")
    verdict = assess(checkpoints, [checkpoints], remote=None)
    assert not verdict.safe and "step-00000200" in verdict.reason


def dvc_env() -> dict:
    return {**os.environ, "PATH": f"{DVC.parent}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture(scope="module")
def dvc_template(tmp_path_factory):
    """git + DVC initialised once; its default remote is the sibling directory remote/, stored as a
    relative path so that every copy of the repository gets a remote of its own."""
    if not DVC.exists():
        pytest.skip("dvc is not installed next to this Python")
    template = tmp_path_factory.mktemp("dvc-template") / "repo"
    template.mkdir()
    for command in (
        ["git", "init", "-q"],
        [str(DVC), "init", "-q"],
        [str(DVC), "remote", "add", "-d", "store", "../remote"],
    ):
        subprocess.run(command, cwd=template, env=dvc_env(), check=True, capture_output=True)
    return template


@pytest.fixture
def dvc_repo(tmp_path, dvc_template):
    """A fresh copy of the template repository with a checkpoint added (`dvc add`, not pushed)."""
    repo, remote = tmp_path / "repo", tmp_path / "remote"
    shutil.copytree(dvc_template, repo, symlinks=True)

    def run(*command):
        subprocess.run(command, cwd=repo, env=dvc_env(), check=True, capture_output=True)

    tag_dir = write_checkpoint(repo / "checkpoints", "run-0123456789ab", 100)
    run(str(DVC), "add", "-q", str(tag_dir.relative_to(repo)))
    return repo, remote, tag_dir, run


@needs_dvc
def test_checkpoint_pushed_to_the_dvc_remote_is_safe(dvc_repo, capsys):
    """After a real `dvc push`, the repository's default remote holds the checkpoint: release is allowed."""
    repo, remote, _, run = dvc_repo
    run(str(DVC), "push", "-q")
    code = guard(
        "--checkpoints",
        str(repo / "checkpoints"),
        "--retained",
        str(remote.parent / "volume"),
        "--dvc-repo",
        str(repo),
    )
    assert code == 0
    assert "DVC remote" in capsys.readouterr().out


@needs_dvc
def test_checkpoint_added_but_not_pushed_is_refused(dvc_repo):
    """`dvc add` without `dvc push` leaves the remote without the checkpoint: refused."""
    repo, remote, _, _ = dvc_repo
    verdict = assess(repo / "checkpoints", [], LocalDvcRemote(remote))
    assert not verdict.safe and "not in the DVC remote" in verdict.reason


@needs_dvc
def test_partially_pushed_checkpoint_is_refused(dvc_repo):
    """A remote missing one file of the checkpoint (an interrupted push) does not count."""
    repo, remote, _, run = dvc_repo
    run(str(DVC), "push", "-q")
    objects = sorted(
        path
        for path in (remote / "files" / "md5").rglob("*")
        if path.is_file() and not path.name.endswith(".dir")
    )
    objects[0].unlink()
    verdict = assess(repo / "checkpoints", [], LocalDvcRemote(remote))
    assert not verdict.safe and "1 of its 2 files" in verdict.reason


@needs_dvc
def test_url_remote_is_checked_with_dvc_ls_url(dvc_repo):
    """A remote reached through `dvc ls-url` (here a local path) is judged the same way."""
    repo, remote, _, run = dvc_repo
    listed = ListedDvcRemote(str(remote), dvc=str(DVC))
    assert not assess(repo / "checkpoints", [], listed).safe
    run(str(DVC), "push", "-q")
    assert assess(repo / "checkpoints", [], ListedDvcRemote(str(remote), dvc=str(DVC))).safe


def test_guard_runs_without_third_party_packages(tmp_path):
    """The guard imports only the standard library, so it also runs inside the worker image."""
    write_checkpoint(tmp_path / "scratch", "run-0123456789ab", 100)
    script = INFRA_DIR / "clipforge_infra" / "teardown_guard.py"
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            str(script),
            "--checkpoints",
            str(tmp_path / "scratch"),
            "--dvc-repo",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == EXIT_REFUSED, done.stderr


@pytest.fixture
def dvc_config_dirs(tmp_path, monkeypatch) -> dict[str, Path]:
    """DVC's global and system config directories, sandboxed in tmp_path for this test."""
    dirs = {level: tmp_path / f"dvc-{level}-config" for level in ("global", "system")}
    for level, path in dirs.items():
        path.mkdir()
        monkeypatch.setenv(f"DVC_{level.upper()}_CONFIG_DIR", str(path))
    return dirs


@needs_dvc
@pytest.mark.parametrize("level", ["global", "system"])
def test_default_remote_set_only_outside_the_repository_counts(
    dvc_repo, dvc_config_dirs, level, capsys
):
    """A default remote set in DVC's global or system config (none in the repository) is the one
    the guard checks, as DVC itself would use it for `dvc push`."""
    repo, _, _, run = dvc_repo
    outside = repo.parent / f"{level}-remote"
    run(str(DVC), "remote", "default", "--unset")
    run(str(DVC), "remote", "add", f"--{level}", "-d", "outside", str(outside))
    args = (
        "--checkpoints",
        str(repo / "checkpoints"),
        "--retained",
        str(repo.parent / "volume"),
        "--dvc-repo",
        str(repo),
    )
    assert guard(*args) == EXIT_REFUSED
    assert f"not in the DVC remote {outside}" in capsys.readouterr().err
    run(str(DVC), "push", "-q")
    assert guard(*args) == 0
    assert f"DVC remote {outside}" in capsys.readouterr().out


@needs_dvc
def test_unreadable_dvc_config_refuses_only_when_the_remote_is_needed(
    dvc_repo, dvc_config_dirs, capsys
):
    """A DVC config DVC cannot parse refuses a checkpoint only a remote could vouch for, saying
    so; a checkpoint on retained storage is still safe."""
    repo, _, _, _ = dvc_repo
    (dvc_config_dirs["global"] / "config").write_text("[core\n")
    checkpoints = repo / "checkpoints"
    assert (
        guard(
            "--checkpoints",
            str(checkpoints),
            "--retained",
            str(repo.parent / "volume"),
            "--dvc-repo",
            str(repo),
        )
        == EXIT_REFUSED
    )
    assert "cannot read the DVC config" in capsys.readouterr().err
    assert (
        guard(
            "--checkpoints",
            str(checkpoints),
            "--retained",
            str(checkpoints),
            "--dvc-repo",
            str(repo),
        )
        == 0
    )
