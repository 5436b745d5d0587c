"""The suite's one polling helper (tests/support/wait.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.wait import still_running, wait_for


def test_returns_the_predicates_first_true_answer():
    answers = iter([None, 0, "done"])
    assert wait_for(lambda: next(answers), what="an answer", interval=0) == "done"


def test_a_process_that_ended_after_making_it_true_is_no_failure():
    """The stage wrote its result and exited: the wait succeeds, the check does not fire."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert wait_for(lambda: True, what="the result", check=still_running(process)) is True


def test_a_process_that_ended_first_fails_at_once_with_its_output():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    with pytest.raises(AssertionError, match=r"ended \(3\) first:\nboom"):
        wait_for(lambda: False, what="never", check=still_running(process, lambda: "boom"))


def test_past_the_limit_the_error_names_what_never_happened():
    with pytest.raises(RuntimeError, match="sshd listening: not reached within 0 s"):
        wait_for(lambda: False, what="sshd listening", timeout=0, error=RuntimeError)
