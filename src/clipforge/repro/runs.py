"""`fab runs`: every run here in one table, best first, and what sets the top ones apart.

Pure: runs in, lines out. A run is a fetched run's folder (clipforge.repro.run_folder: `fab fetch`
put it under runs/<launch id>) or a DVC experiment, as `dvc exp show --json` describes it (the
demo, `dvc exp run`, a fetched run's experiment), the workspace and a commit with metrics among
them. clipforge.repro.commands reads them.

A row: the run's name (a fetched run's launch id, marked `smoke` for `fab train --smoke`, as is
the experiment `fab fetch` brought with it, named `<launch id>[-smoke]`; another experiment's
name), each eval suite's headline number (retrieval's mean recall, classification's
top-1) and their mean, best first by --sort-by. The same results twice (a fetched run and the
experiment `fab fetch` brought with it, the workspace and the experiment it holds, the demo run
again unchanged) are one row: two rows with equal metrics files would tell nothing apart.
"""

from __future__ import annotations

import difflib
import json
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from clipforge.errors import UserError
from clipforge.eval.config import RESERVED_SUITE_NAMES as NOT_SUITES  # eval.json's non-suite keys
from clipforge.eval.stage import HEADLINE, MEAN_KEY
from clipforge.repro.experiments import experiment_name, launch_of
from clipforge.repro.run_folder import RunFolder
from clipforge.util import flatten

EVAL_FILE = "metrics/eval.json"
# Each suite's headline number: eval.json names no kind, so a suite's headline is the one it has.
HEADLINES = tuple(HEADLINE.values())
DEFAULT_SORT = MEAN_KEY
WORKSPACE = "workspace"  # the name `dvc exp show` and `dvc plots diff` give the working tree
SMOKE = "smoke"
MAX_NAME = 30  # a launch id and its smoke mark; longer experiment names end in `…`
MIN_COLUMN = 5
HEADER_FLOOR = 12  # a suite's name cut to this before a suite's column goes


class RunsError(UserError):
    """No run to list, or a metric no run has; the message says what to do."""


@dataclass(frozen=True)
class Run:
    name: str
    metric_files: dict[str, dict]  # each metrics file, parsed, by its path ("metrics/eval.json")
    params: dict[str, object]  # dotted keys
    smoke: bool = False
    experiment: str | None = None  # a revision `dvc plots diff` takes
    folder: str | None = None  # what `fab compare` takes

    @property
    def label(self) -> str:
        return f"{self.name} {SMOKE}" if self.smoke else self.name

    @cached_property
    def metrics(self) -> dict[str, float]:
        """Every number, by its `dvc exp show` column: test.mean_recall, val_loss, ..."""
        found: dict = {}
        for data in self.metric_files.values():
            found.update(flatten(data))
        return {
            k: v
            for k, v in found.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }

    @cached_property
    def headlines(self) -> dict[str, str]:
        """Each suite's headline metric, by suite name, in eval.json's order."""
        found = {}
        for suite, value in self.metric_files.get(EVAL_FILE, {}).items():
            if suite in NOT_SUITES or not isinstance(value, dict):
                continue
            headline = next((k for k in HEADLINES if k in value), None)
            if headline:
                found[suite] = f"{suite}.{headline}"
        return found


def from_folder(folder: RunFolder, compare_as: str) -> Run:
    """A fetched run: named by its launch id (its folder's name if none); `compare_as` is what
    `fab compare` takes for it."""
    return Run(
        name=folder.launch_id or folder.name,
        metric_files=folder.metric_files,
        params=flatten(folder.params),
        smoke=folder.smoke,
        folder=compare_as,
    )


def from_experiments(shown: object) -> list[Run]:
    """The runs of `dvc exp show --json` that have metrics: the experiments first (newest first,
    as DVC lists them), then the commits, then the workspace: where two hold the same results,
    the row kept is the first's (clipforge.repro.runs.merge), named as `dvc plots diff` will
    still find it later."""
    baselines = shown if isinstance(shown, list) else []
    experiments, commits, workspace = [], [], []
    for baseline in baselines:
        for group in baseline.get("experiments") or []:
            tip = (group.get("revs") or [{}])[0]
            name = group.get("name") or tip.get("name") or str(tip.get("rev", ""))[:7]
            experiments.append(_experiment(tip, name, None))
        rev = str(baseline.get("rev", ""))
        if rev == WORKSPACE:
            workspace.append(_experiment(baseline, WORKSPACE, "."))
        else:
            commits.append(_experiment(baseline, baseline.get("name") or rev[:7], None))
    return [run for run in experiments + commits + workspace if run is not None]


def _experiment(entry: dict, name: str, folder: str | None) -> Run | None:
    data = entry.get("data") or {}
    metric_files = {
        path: found["data"]
        for path, found in (data.get("metrics") or {}).items()
        if isinstance(found, dict) and isinstance(found.get("data"), dict)
    }
    if not metric_files:  # queued, failed, or a commit without results
        return None
    files = data.get("params") or {}
    params: dict[str, object] = {}
    # params.yaml first: the stages' resolved copies (resolved/*.yaml) spell out its defaults
    for path in sorted(files, key=lambda p: (p != "params.yaml", p)):
        if isinstance(files[path], dict) and isinstance(files[path].get("data"), dict):
            params.update(flatten(files[path]["data"]))
    launch = launch_of(name)  # a fetched run's experiment, kept after its folder went
    if launch:
        return Run(launch[0], metric_files, params, launch[1], experiment=name, folder=folder)
    return Run(name, metric_files, params, experiment=name, folder=folder)


def merge(fetched: Sequence[Run], experiments: Sequence[Run]) -> tuple[list[Run], list[str]]:
    """One row per result: a fetched run takes the experiment with its metrics files (the one
    `fab fetch` brought) as its own; another experiment with the results of a row already kept is
    left out. Returns the rows and a note per run left out."""
    kept, notes = [], []
    pool = list(experiments)
    for run in fetched:
        twin = next(
            (e for e in pool if run.metric_files and e.metric_files == run.metric_files), None
        )
        if twin is not None:
            pool.remove(twin)
            run = replace(run, experiment=twin.experiment)
        kept.append(run)
    for run in pool:
        same = next((k for k in kept if k.metric_files == run.metric_files), None)
        if same is None:
            kept.append(run)
        else:
            notes.append(f"{run.name} (the same results as {same.name})")
    return kept, notes


def lower_is_better(key: str) -> bool:
    return key.rsplit(".", 1)[-1].endswith("loss")


def ordered(runs: Sequence[Run], sort_by: str) -> list[Run]:
    """Best first by `sort_by`: the highest, or the lowest of a loss; runs without it last."""
    known = sorted({key for run in runs for key in run.metrics})
    if sort_by not in known:
        close = difflib.get_close_matches(sort_by, known, n=3)
        examples = [k for k in (MEAN_KEY, *_headline_keys(runs), "val_loss") if k in known][:4]
        raise RunsError(
            f"--sort-by {sort_by}: no run has that metric; "
            + (f"did you mean {' or '.join(close)}? " if close else "")
            + "it takes any key of metrics/eval.json or train.json, as `dvc exp show` names it"
            + (f": {', '.join(examples)}" if examples else "")
        )
    sign = 1 if lower_is_better(sort_by) else -1
    with_it = [r for r in runs if sort_by in r.metrics]
    return sorted(with_it, key=lambda r: sign * r.metrics[sort_by]) + [
        r for r in runs if sort_by not in r.metrics
    ]


def _headline_keys(runs: Iterable[Run]) -> list[str]:
    return list(dict.fromkeys(key for run in runs for key in run.headlines.values()))


@dataclass(frozen=True)
class Column:
    header: str
    key: str  # the metric it shows
    number: str  # its format
    keep: bool = False  # kept when columns must go to fit the width
    suite: bool = False  # a suite's headline


def columns(runs: Sequence[Run], sort_by: str) -> list[Column]:
    """Each suite's headline, the mean, and the sort metric where it is none of them."""
    suites = list(dict.fromkeys(s for run in runs for s in run.headlines))
    keys = {s: next(r.headlines[s] for r in runs if s in r.headlines) for s in suites}
    shown = [Column(s, keys[s], "{:.2f}", keep=keys[s] == sort_by, suite=True) for s in suites]
    shown.append(Column("mean", MEAN_KEY, "{:.2f}", keep=True))
    if sort_by not in keys.values() and sort_by != MEAN_KEY:
        shown.append(Column(sort_by, sort_by, "{:.4g}", keep=True))
    return shown


def _cell(run: Run, column: Column) -> str:
    value = run.metrics.get(column.key)
    return "-" if value is None else column.number.format(value)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _cut_middle(text: str, width: int) -> str:
    """Both ends kept: suites' names often differ at the end (retrieval-1, retrieval-2)."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def fit(
    names: Sequence[str], cells: list[list[str]], chosen: list[Column], width: int
) -> tuple[int, list[int], list[int]]:
    """Column widths within `width`: headers cut to HEADER_FLOOR characters first, then the
    columns not kept dropped from the right, then the kept ones' headers cut to their numbers'
    width. Returns the name width, the columns shown and every column's width."""
    name_width = min(MAX_NAME, max(len(n) for n in [*names, "run"]))
    shown = list(range(len(chosen)))
    widths = [max([len(chosen[i].header), *(len(row[i]) for row in cells)]) for i in shown]
    numbers = [max([MIN_COLUMN, *(len(row[i]) for row in cells)]) for i in shown]

    def total() -> int:
        return name_width + sum(widths[i] + 2 for i in shown)

    def shrink(floor: list[int]) -> None:
        while total() > width and any(widths[i] > floor[i] for i in shown):
            widest = max((i for i in shown if widths[i] > floor[i]), key=lambda i: widths[i])
            widths[widest] -= 1

    shrink([max(n, HEADER_FLOOR) for n in numbers])
    while total() > width and any(not chosen[i].keep for i in shown):
        shown.remove(max(i for i in shown if not chosen[i].keep))
    shrink(numbers)
    return name_width, shown, widths


def format_runs(
    runs: Sequence[Run],
    sort_by: str = DEFAULT_SORT,
    with_params: bool = False,
    width: int = 80,
    left_out: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> list[str]:
    """The table, best first, then what its columns are, the runs left out (the same results as
    a row's), the notes (what could not be read), and last the commands that compare the top
    two."""
    if not runs:
        raise RunsError("no runs to list")
    rows = ordered(runs, sort_by)
    chosen = columns(rows, sort_by)
    cells = [[_cell(run, c) for c in chosen] for run in rows]
    name_width, shown, widths = fit([r.label for r in rows], cells, chosen, width)
    headers = [_cut_middle(chosen[i].header, widths[i]) for i in shown]
    lines = [_line("run", headers, name_width, shown, widths)]
    differing = differing_params(rows) if with_params else []
    for run, row in zip(rows, cells):
        lines.append(_line(run.label, [row[i] for i in shown], name_width, shown, widths))
        if differing:
            lines += _params_lines(run, differing, width)
    lines += _wrap(legend(chosen, [chosen[i] for i in shown], sort_by), width)
    if with_params and not differing:
        lines.append("params: the same in every run")
    if left_out:
        lines += _wrap("left out: " + ", ".join(left_out), width)
    for note in notes:
        lines += _wrap(f"({note})", width)
    return lines + pointers(rows, width)


def _line(
    name: str, values: list[str], name_width: int, shown: list[int], widths: list[int]
) -> str:
    cells = [_cut(name, name_width).ljust(name_width)]
    cells += [_cut(v, widths[i]).rjust(widths[i]) for v, i in zip(values, shown)]
    return "  ".join(cells).rstrip()


def legend(chosen: list[Column], shown: list[Column], sort_by: str) -> str:
    """What the numbers are: each suite's headline, the mean's key, the order."""
    by_headline: dict[str, list[str]] = {}
    for column in shown:
        if column.suite:
            by_headline.setdefault(column.key.rsplit(".", 1)[-1], []).append(column.header)
    kinds = " or ".join(f"{k} ({', '.join(v)})" for k, v in by_headline.items())
    dropped = [c.header for c in chosen if c not in shown]
    order = "lowest" if lower_is_better(sort_by) else "highest"
    return (
        (f"each suite's {kinds}; " if kinds else "")
        + f"mean: {MEAN_KEY}; best first: {order} {sort_by} (--sort-by)"
        + (f"; not shown, to fit: {', '.join(dropped)}" if dropped else "")
    )


def differing_params(runs: Sequence[Run]) -> list[str]:
    """The params whose value is not the same in every run that has them."""
    keys = dict.fromkeys(key for run in runs for key in run.params)
    return [
        key
        for key in keys
        if len({_value(run.params[key]) for run in runs if key in run.params}) > 1
    ]


def _params_lines(run: Run, keys: list[str], width: int) -> list[str]:
    text = "  ".join(f"{k}={_value(run.params[k])}" for k in keys if k in run.params)
    return textwrap.wrap(
        text or "(none of them)", width, initial_indent="  ", subsequent_indent="    "
    )


def _value(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return _cut(text, 40)


def pointers(rows: Sequence[Run], width: int = 80) -> list[str]:
    """The commands that compare the top two: their curves (two DVC revisions), and their params,
    data, environment and weights (two run folders). An experiment named otherwise than its row
    (one fetched before experiments took the launch id) is tied to its row by a comment."""
    if len(rows) < 2:
        return []
    a, b = rows[0], rows[1]
    commands = []
    if a.experiment and b.experiment:
        command = f"  dvc plots diff {a.experiment} {b.experiment}"
        aliases = [
            f"{r.experiment}: {r.name}"
            for r in (a, b)
            if r.experiment != experiment_name(r.name, r.smoke)
        ]
        comment = f"  # {', '.join(aliases)}" if aliases else ""
        if len(command + comment) <= width:
            commands.append(command + comment)
        else:  # the comment on a line of its own
            commands += [command, comment]
    if a.folder and b.folder:
        commands.append(f"  fab compare {a.folder} {b.folder}")
    return ["compare the top two:", *commands] if commands else []


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False)
