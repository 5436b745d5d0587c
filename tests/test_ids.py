"""The two ids: a launch id (one `fab train`) and a run id (one training run), each made by one
constructor and read back by one parser."""

from __future__ import annotations

import calendar

import pytest

from clipforge.errors import UserError
from clipforge.ids import (
    IdError,
    checked_launch_id,
    is_run_id,
    launch_id_of,
    new_launch_id,
    parse_launch_id,
    parse_run_id,
    run_id_for,
    run_ids_in,
)


def test_a_launch_id_is_its_utc_start_and_commit_and_no_run_id():
    now = calendar.timegm((2026, 1, 2, 3, 4, 5))
    launch_id = new_launch_id("abcdef1234567890", now)
    assert launch_id == "20260102-030405-abcdef12"
    assert not is_run_id(launch_id)


def test_a_run_id_depends_only_on_its_fingerprint():
    run_id = run_id_for({"data": "d", "model": {"name": "m"}, "train": {"lr": 1e-3}})
    assert run_id == run_id_for({"train": {"lr": 1e-3}, "model": {"name": "m"}, "data": "d"})
    assert run_id != run_id_for({"data": "other", "model": {"name": "m"}, "train": {"lr": 1e-3}})
    assert is_run_id(run_id) and len(run_id) == len("run-") + 12


def test_the_run_ids_of_a_checkpoints_directory_are_its_run_folders(tmp_path):
    for name in ("run-0123456789ab", "run-ba9876543210", "run-short", "damaged-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "run-aaaaaaaaaaaa").write_text("a file, not a run")
    assert run_ids_in(tmp_path) == ["run-0123456789ab", "run-ba9876543210"]
    assert run_ids_in(tmp_path / "missing") == []


def test_a_run_record_names_its_launch_under_launch_id_only():
    """`run_id` is the training run's: a record's launch is its `launch_id`, never that."""
    assert launch_id_of({"launch_id": "20260102-030405-abcdef12"}) == "20260102-030405-abcdef12"
    assert launch_id_of({"run_id": "run-0123456789ab"}) is None
    assert launch_id_of({}) is None


def test_an_id_from_outside_is_refused_naming_where_it_came_from():
    """Ids name folders: text that is not one (`..`, a path, digits of another script, a
    trailing newline, an over-long commit) is a user error naming its source and shown escaped."""
    for text in ("../../victim", "/tmp", "２０２６０１０２-030405-abcdef12", "20260102-030405-ab\n",
                 "20260102-030405-" + "a" * 41, None, 7):  # fmt: skip
        with pytest.raises(IdError, match=r"^host:/r/current: not a launch id: ") as error:
            checked_launch_id(text, "host:/r/current")
        assert "\n" not in str(error.value) and isinstance(error.value, UserError)
    assert checked_launch_id("20260102-030405-abcdef12", "--launch") == "20260102-030405-abcdef12"
    with pytest.raises(IdError, match=r"^store: training_run: not a run id: '\.\./x'"):
        parse_run_id("../x", "store: training_run")
    with pytest.raises(IdError, match=r"not a launch id: 'x+\.\.\.x+' \(expected"):
        parse_launch_id("x" * 1000)
