"""The one polling helper of the suite: wait until something holds, or say what never did.

A timeout here is a safety limit for a test that would otherwise hang, never a speed assertion:
make it generous. Where the code under test can signal (a threading.Event, a condition, a
process's exit), wait on that instead of polling.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    *,
    what: str,
    timeout: float = 300.0,
    interval: float = 0.05,
    check: Callable[[], object] | None = None,
    error: type[Exception] = AssertionError,
) -> T:
    """Call predicate() every `interval` seconds until it returns something true, and return
    that. While it is false, `check()` (if given) may raise to give up early (the process that
    was to make it true has ended); a predicate that came true meanwhile still wins. Past
    `timeout` seconds, raise `error` naming `what`."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if check is not None:
            try:
                check()
            except Exception:
                if result := predicate():  # it came true just before the end
                    return result
                raise
        if time.monotonic() > deadline:
            raise error(f"{what}: not reached within {timeout:g} s")
        time.sleep(interval)
    return result


def still_running(process: subprocess.Popen, output: Callable[[], str] = str) -> Callable[[], None]:
    """A wait_for check: fail, with the process's `output()`, once the process has ended."""

    def check() -> None:
        if process.poll() is not None:
            raise AssertionError(f"the process ended ({process.returncode}) first:\n{output()}")

    return check
