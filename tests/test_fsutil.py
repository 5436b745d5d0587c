"""Atomic writes: a reader sees the old file or the whole new one, never a part, and nothing is
left behind; a name from outside becomes a path only inside its folder."""

from __future__ import annotations

import os
import stat

import pytest

from clipforge.errors import UserError
from clipforge.fsutil import (
    UnsafeNameError,
    atomic_file,
    atomic_write_text,
    give_default_modes,
    join_inside,
    replace_dir_atomically,
    restrict_umask,
)


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


def test_a_name_from_outside_joins_its_folder_only_when_it_stays_inside(tmp_path):
    """join_inside: nested names are joined as they are; `..`, absolute paths, empty and `.`
    components, control characters and components over 255 bytes are refused with a user error
    naming the name and its source, and nothing is created."""
    assert join_inside(tmp_path, "logs/train/events.1", "store") == tmp_path / "logs/train/events.1"
    assert join_inside(tmp_path, "数据/标签.txt", "store") == tmp_path / "数据" / "标签.txt"
    refused = {
        "../x": "'..' component",
        "a/../../x": "'..' component",
        "/etc/passwd": "absolute path",
        "a//b": "empty component",
        "./a": "'.' component",
        "a\nb": "control character",
        "a\x1b[2Jb": "control character",
        "a\udcff": "undecodable",
        "x" * 256: "over 255 bytes",
        "": "not a file name",
    }
    for name, why in refused.items():
        with pytest.raises(UnsafeNameError, match=why) as error:
            join_inside(tmp_path, name, "the run store s3://b/run-x/logs")
        message = str(error.value)
        assert message.startswith("the run store s3://b/run-x/logs names ") and "\n" not in message
        assert isinstance(error.value, UserError)
    assert list(tmp_path.iterdir()) == []


def test_a_name_through_a_symbolic_link_below_its_folder_is_refused(tmp_path):
    """A link below the folder (made by anyone) would carry a write elsewhere: refused, naming
    the link; a link above the folder (the user's own `runs -> /data/runs`) is the folder."""
    elsewhere, folder = tmp_path / "elsewhere", tmp_path / "real-runs"
    elsewhere.mkdir(), folder.mkdir()
    (folder / "run").symlink_to(elsewhere)
    with pytest.raises(UnsafeNameError, match="run is a symbolic link"):
        join_inside(folder, "run/logs/x", "host")
    (folder / "file").symlink_to(elsewhere / "target")
    with pytest.raises(UnsafeNameError, match="file is a symbolic link"):
        join_inside(folder, "file", "host")
    (tmp_path / "runs").symlink_to(folder)
    assert join_inside(tmp_path / "runs", "other/x", "host") == tmp_path / "runs" / "other" / "x"


@pytest.mark.parametrize("umask, restricted", [(0o022, 0o027), (0o002, 0o027), (0o077, 0o077)])
def test_a_run_writes_group_readable_at_most_and_a_stricter_umask_stays(
    tmp_path, umask, restricted
):
    """restrict_umask (every stage, the host's supervisor): the group may read, not write; others
    get nothing; a user's stricter umask is kept. It returns the umask it replaced."""
    previous = os.umask(umask)
    try:
        assert restrict_umask() == umask
        atomic_write_text(tmp_path / "metrics" / "eval.json", "{}\n")
        assert os.umask(0o022) == restricted
    finally:
        os.umask(previous)
    assert (tmp_path / "metrics" / "eval.json").stat().st_mode & 0o777 == 0o666 & ~restricted
    assert (tmp_path / "metrics").stat().st_mode & 0o777 == 0o777 & ~restricted


def test_files_a_library_wrote_with_its_own_mode_get_the_umasks(tmp_path):
    """give_default_modes: safetensors writes 0600, the config 0644; afterwards every file of the
    folder has the one mode a new file gets, every folder a new folder's."""
    (tmp_path / "transformers").mkdir(mode=0o700)
    (tmp_path / "open_clip_model.safetensors").write_bytes(b"w")
    (tmp_path / "open_clip_model.safetensors").chmod(0o600)
    (tmp_path / "transformers" / "config.json").write_text("{}")
    (tmp_path / "transformers" / "config.json").chmod(0o664)
    previous = os.umask(0o027)
    try:
        give_default_modes(tmp_path)
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [tmp_path, *tmp_path.rglob("*")]}
    assert modes == {
        tmp_path.name: 0o750,
        "transformers": 0o750,
        "open_clip_model.safetensors": 0o640,
        "config.json": 0o640,
    }
