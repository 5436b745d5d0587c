"""The I/O shells of `fab compare`, `fab publish` and `fab pull`: find the runs, print, decide.

The logic is in clipforge.repro.compare (pure) and clipforge.repro.publish; fabfile.py only
parses the options and turns the result into an exit status.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from clipforge.errors import UserError
from clipforge.export.card import rerun_command
from clipforge.repro import publish
from clipforge.repro.compare import compare, format_report
from clipforge.repro.run_folder import RunFolder, find_run, read_run


def parse_tolerance(text: object) -> float:
    try:
        value = float(str(text))
    except ValueError:
        raise UserError(
            f"--tolerance: a number (an absolute metric difference), got {text!r}"
        ) from None
    if not value >= 0:
        raise UserError(f"--tolerance: zero or more, got {text!r}")
    return value


def compare_runs(
    run_a: str, run_b: str, tolerance: float, say: Callable[[str], None], runs: Path = Path("runs")
) -> bool:
    """Print the comparison of two run folders (or launch ids under runs/); True: they agree."""
    result = compare(read_run(find_run(run_a, runs)), read_run(find_run(run_b, runs)), tolerance)
    say(format_report(result))
    return result.passed


def rerun_line(run: RunFolder) -> str | None:
    """The command that repeats the run, as its model card says it; None: `fab train` did not
    start it, and `fab rerun` repeats only such runs."""
    return rerun_command(run.launch_id) if run.launch_id else None


def publish_run(run: str, url: str, say: Callable[[str], None], runs: Path = Path("runs")) -> None:
    folder = read_run(find_run(run, runs))
    publish.publish(folder, url, rerun_line(folder), say)


def pull_model(url: str, to: str, say: Callable[[str], None]) -> Path:
    return publish.pull(url, Path(to), say)
