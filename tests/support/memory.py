"""The peak memory of a command, as the kernel counts it: the largest resident set of the command
and its descendants (getrusage's ru_maxrss of the children a process has waited for).

The command runs under a small Python parent of its own, so the figure is the command's alone:
pytest's own RUSAGE_CHILDREN would hold the largest child any earlier test started.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

_MEASURE = (
    "import resource, subprocess, sys\n"
    "limit = int(sys.argv[2])\n"
    "if limit:\n"
    "    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
    "code = subprocess.call(sys.argv[3:])\n"
    "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "open(sys.argv[1], 'w').write(str(peak))\n"
    "sys.exit(code)\n"
)


def run_measured(
    argv: list[str], max_address_space: int = 0, **kwargs
) -> tuple[subprocess.CompletedProcess, int]:
    """(the finished command, with its output captured as text; its peak resident set size in
    bytes). max_address_space: a limit the command cannot pass (RLIMIT_AS, bytes; 0: none), for
    a command that would otherwise take the machine's memory when the test fails. kwargs go to
    subprocess.run (env, cwd, timeout)."""
    with tempfile.TemporaryDirectory(prefix="peak-rss-") as directory:
        report = Path(directory) / "peak"
        result = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(report), str(max_address_space), *argv],
            capture_output=True,
            text=True,
            **kwargs,
        )
        peak_kib = int(report.read_text())  # Linux counts ru_maxrss in KiB
    return result, peak_kib * 1024
