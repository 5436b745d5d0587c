"""The small helpers of clipforge.util, on real parts (a loopback HTTP server, a process)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

from clipforge.util import (
    backoff_seconds,
    exception_summary,
    first_line,
    format_duration,
    short_repr,
    total_steps,
    wait_script,
    wait_until_answering,
)


def test_backoff_doubles_from_its_base_up_to_its_cap():
    assert [backoff_seconds(n, 2.0, 10.0) for n in range(1, 6)] == [2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff_seconds(4, 0.5) == 4.0  # no cap
    assert backoff_seconds(3, 0.0, 5.0) == 0.0


def test_first_line_skips_blank_lines_and_a_heading_ending_in_a_colon():
    assert first_line(ValueError("\n  bad value  \nmore")) == "bad value"
    assert first_line(RuntimeError("Error(s) in loading state_dict:\n\tsize mismatch")) == (
        "size mismatch"
    )
    assert first_line(KeyError()) == "KeyError"
    assert exception_summary(OSError("no route\nto host")) == "OSError: no route"
    assert exception_summary(TimeoutError()) == "TimeoutError"
    assert len(exception_summary(ValueError("x" * 500), max_chars=40)) == 40


def test_durations_read_as_hours_minutes_seconds():
    assert format_duration(3723.9) == "1h02m03s"
    assert format_duration(59) == "0m59s"
    assert format_duration(-5) == "0m00s"


def test_total_steps_is_max_steps_when_set_else_the_epochs_steps():
    assert total_steps(None, 3, 40) == 120
    assert total_steps(7, 3, 40) == 7


def test_waiting_returns_once_a_server_answers():
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert wait_until_answering(f"http://127.0.0.1:{server.server_port}/", 30)
    finally:
        server.shutdown()
        server.server_close()


def test_waiting_stops_at_once_when_the_server_process_is_gone():
    """A server that exited never answers: the wait says so without sitting out its timeout."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    closed = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{closed.server_port}/"
    closed.server_close()  # nothing listens there now
    assert not wait_until_answering(url, 3600, alive=lambda: process.poll() is None)


def test_the_wait_script_runs_in_a_bare_python_as_on_a_host():
    """What the launcher runs on a GPU host (its checkout may predate clipforge.util): the
    helper's own source, in a Python without site-packages or clipforge on its path."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/"
    try:
        answered = subprocess.run(
            [sys.executable, "-S", "-c", wait_script(url, 30)], env={}, timeout=60
        )
    finally:
        server.shutdown()
        server.server_close()
    assert answered.returncode == 0
    silent = subprocess.run([sys.executable, "-S", "-c", wait_script(url, 0)], env={}, timeout=60)
    assert silent.returncode == 1


def test_a_value_is_shown_in_at_most_200_characters_without_its_whole_repr():
    """What error messages quote: a short value as repr gives it; a 10 MB string, a list of
    lists shared 9 levels deep (387 million strings once expanded, as a YAML alias bomb is) and
    an integer repr() refuses are cut while they are written, never built whole."""
    assert short_repr("abc") == "'abc'" and short_repr([1, "x"]) == "[1, 'x']"
    assert len(short_repr("x" * 10_000_000)) <= 200
    shared: list = ["lol"] * 9
    for _ in range(8):
        shared = [shared] * 9
    assert short_repr(shared).startswith("[[[[") and len(short_repr(shared)) <= 200
    assert short_repr(10**5000) == "<an integer of 16610 bits>"
    assert short_repr("abcdef", max_chars=5) == "'a..."
