"""Atomic writes: a reader sees the old file or the whole new one, never a part, and nothing is
left behind."""

from __future__ import annotations

import os
import stat

import pytest

from clipforge.fsutil import atomic_file, atomic_write_text, replace_dir_atomically


def test_replacing_a_file_keeps_its_mode(tmp_path):
    """A rewritten pyproject.toml or Dockerfile stays readable by all (the temporary file is
    created private)."""
    target = tmp_path / "pyproject.toml"
    target.write_text("old\n")
    target.chmod(0o644)
    atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n"
    assert target.stat().st_mode & 0o777 == 0o644


def test_replacing_a_link_replaces_the_link_never_its_target(tmp_path):
    """A `latest` that is a link: the rewrite neither follows it nor takes its target's mode."""
    target = tmp_path / "elsewhere"
    target.write_text("theirs\n")
    target.chmod(0o604)
    (tmp_path / "latest").symlink_to(target)
    atomic_write_text(tmp_path / "latest", "step-00000008\n")
    assert not (tmp_path / "latest").is_symlink()
    assert (tmp_path / "latest").read_text() == "step-00000008\n"
    assert stat.S_IMODE((tmp_path / "latest").stat().st_mode) != 0o604
    assert target.read_text() == "theirs\n" and stat.S_IMODE(target.stat().st_mode) == 0o604


def test_a_streamed_file_is_committed_where_its_content_says(tmp_path):
    """atomic_file: written first, named afterwards; only the committed name exists at the end."""
    with atomic_file(tmp_path, suffix=".parquet") as staged:
        staged.path.write_text("rows\n")
        staged.commit(tmp_path / "key-1234.parquet")
    assert sorted(os.listdir(tmp_path)) == ["key-1234.parquet"]


def test_an_error_or_no_commit_leaves_no_trace_and_the_old_file(tmp_path):
    """An interrupted write, or one whose result is not needed (the same rows already there),
    leaves the old file as it was and no temporary file beside it."""
    target = tmp_path / "input.parquet"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path) as staged:
            staged.path.write_text("half")
            raise RuntimeError("interrupted")
    with atomic_file(tmp_path) as staged:
        staged.path.write_text("not needed")
    assert os.listdir(tmp_path) == ["input.parquet"] and target.read_text() == "old\n"


@pytest.mark.parametrize(
    "umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)]
)
def test_new_outputs_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    """A new file or directory (an exported model, metrics) gets the mode any tool would give it,
    readable by teammates on shared storage when the umask allows, not a private 0600."""
    previous = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "metrics" / "eval.json", "{}\n")
        with replace_dir_atomically(tmp_path / "models" / "clip") as staged:
            (staged / "open_clip_config.json").write_text("{}\n")
    finally:
        os.umask(previous)
    assert (tmp_path / "metrics" / "eval.json").stat().st_mode & 0o777 == file_mode
    assert (tmp_path / "models" / "clip").stat().st_mode & 0o777 == dir_mode
    assert (
        tmp_path / "models" / "clip" / "open_clip_config.json"
    ).stat().st_mode & 0o777 == file_mode
