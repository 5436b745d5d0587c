"""The I/O shells of `fab runs`, `compare`, `publish` and `pull`: find the runs, print, decide.

The logic is in clipforge.repro.runs and clipforge.repro.compare (pure) and
clipforge.repro.publish; fabfile.py only parses the options and turns the result into an exit
status.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from clipforge.errors import UserError
from clipforge.export.card import rerun_command
from clipforge.repro import publish
from clipforge.repro import runs as runs_mod
from clipforge.repro.compare import compare, format_report
from clipforge.repro.experiments import experiments_here
from clipforge.repro.run_folder import RunFolder, RunFolderError, find_run, read_run

DEFAULT_RUNS = Path("runs")  # where `fab fetch` puts runs (its --to)


def list_runs(
    sort_by: str,
    with_params: bool,
    say: Callable[[str], None],
    runs: Path = DEFAULT_RUNS,
    repo: Path = Path("."),
) -> None:
    """Print every run here, fetched under `runs` or a DVC experiment of `repo`, best first."""
    fetched, unread = fetched_runs(runs)
    experiments, dvc_failed = experiments_here(repo)
    rows, same = runs_mod.merge(fetched, runs_mod.from_experiments(experiments))
    if not rows:
        raise runs_mod.RunsError(
            f"no runs here: no DVC experiment with metrics, nothing fetched under {runs}/; "
            "make one with `make demo` (or `dvc exp run`), or bring one home with "
            "`fab fetch --launch ID`" + (f" ({dvc_failed})" if dvc_failed else "")
        )
    width = shutil.get_terminal_size((80, 24)).columns
    notes = unread + ([dvc_failed] if dvc_failed else [])
    for line in runs_mod.format_runs(rows, sort_by, with_params, width, same, notes):
        say(line)


def fetched_runs(runs: Path) -> tuple[list[runs_mod.Run], list[str]]:
    """The runs `fab fetch` put under `runs`, and a note for each folder there that is not a
    finished run's. A folder without metrics/ is none (`fab tensorboard --from-store` keeps
    only logs there); dot-names are a fetch under way."""
    found, unread = [], []
    folders = sorted(runs.iterdir()) if runs.is_dir() else []
    for path in folders:
        if path.name.startswith(".") or not (path / "metrics").is_dir():
            continue
        try:
            folder = read_run(path)
        except RunFolderError as exc:
            unread.append(f"left out: {exc}")
            continue
        compare_as = path.name if runs == DEFAULT_RUNS else str(path)
        found.append(runs_mod.from_folder(folder, compare_as))
    return found, unread


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
