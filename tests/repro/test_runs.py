"""`fab runs` (clipforge.repro.runs): every run in one table within 80 columns, best first, the
params that set them apart, and the commands that compare the top two."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clipforge.repro import runs
from clipforge.repro.commands import list_runs
from clipforge.repro.runs import EVAL_FILE, Run, RunsError, format_runs, merge
from tests.conftest import REPO, git
from tests.support.repro_runs import PARAMS, fab, make_run

TRAIN_FILE = "metrics/train.json"


def eval_json(mean: float, suites: dict[str, float] | None = None) -> dict:
    """eval.json as the eval stage writes it: a suite's metrics under its name, then the mean."""
    suites = suites or {"test": mean, "t2i-distractors": mean / 2, "colour-shape": mean * 2}
    record: dict = {}
    for name, value in suites.items():
        headline = "top1" if name == "colour-shape" else "mean_recall"
        record[name] = {headline: value, "t2i_r01": value / 4, "few_t2i_queries": 0}
    return {**record, "mean_over_suites": mean}


def made_up(name: str, mean: float, val_loss: float | None = None, **fields) -> Run:
    files = {EVAL_FILE: eval_json(mean)}
    if val_loss is not None:
        files[TRAIN_FILE] = {"loss": val_loss / 2, "val_loss": val_loss}
    fields.setdefault("experiment", name)
    return Run(name, files, fields.pop("params", {"train.lr": 0.001}), **fields)


def table_rows(lines: list[str], count: int) -> list[str]:
    return [line.split()[0] for line in lines[1 : count + 1]]


def test_the_best_mean_over_suites_comes_first_and_the_lowest_loss_first():
    worst, best, middle = made_up("a", 10.0, 1.0), made_up("b", 30.0, 2.0), made_up("c", 20.0)
    assert table_rows(format_runs([worst, best, middle]), 3) == ["b", "c", "a"]
    # a run without the metric goes last, whatever the order
    assert table_rows(format_runs([middle, best, worst], "val_loss"), 3) == ["a", "b", "c"]
    by_top1 = format_runs([worst, best, middle], "colour-shape.top1")
    assert table_rows(by_top1, 3) == ["b", "c", "a"]
    assert "best first: highest colour-shape.top1" in " ".join(by_top1)


def test_a_row_shows_each_suites_headline_and_the_mean():
    header, row, *rest = format_runs([made_up("demo", 30.0)])
    assert header.split() == ["run", "test", "t2i-distractors", "colour-shape", "mean"]
    assert row.split() == ["demo", "30.00", "15.00", "60.00", "30.00"]
    legend = " ".join(rest)
    assert "mean_recall (test, t2i-distractors) or top1 (colour-shape)" in legend


def test_every_line_fits_80_columns_with_many_suites_and_long_names():
    suites = {f"retrieval-suite-{i}": 10.0 + i for i in range(8)}
    long_name = Run(
        "a-custom-experiment-name-far-longer-than-a-launch-id",
        {EVAL_FILE: eval_json(40.0, suites)},
        {},
        experiment="a-custom-experiment-name-far-longer-than-a-launch-id",
    )
    better = {name: value + 1 for name, value in suites.items()}
    smoke = Run("20261201-101112-abcdef01", {EVAL_FILE: eval_json(50.0, better)}, {}, smoke=True)
    lines = format_runs([long_name, smoke], "retrieval-suite-7.t2i_r01", with_params=True)
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    # suites' names cut in the middle, the ones on the right dropped; the mean and the sort
    # metric stay
    assert lines[0].split() == ["run", "retri…uite-0", "retri…uite-1", "mean", "retri…2i_r01"]
    assert lines[1].split() == [
        "20261201-101112-abcdef01",
        "smoke",
        "11.00",
        "12.00",
        "50.00",
        "4.5",
    ]
    assert lines[2].startswith("a-custom-experiment-name-far-…  ")
    legend = " ".join(lines[3:])
    assert "not shown, to fit: retrieval-suite-2, retrieval-suite-3," in legend


def test_the_demos_three_suites_fit_80_columns_beside_a_smoke_launch_whole():
    smoke = made_up("20261201-101112-abcdef01", 2.31, smoke=True, experiment=None)
    lines = format_runs([made_up("gammy-prep", 32.69), smoke])
    assert max(map(len, lines)) <= 80 and "…" not in "\n".join(lines)
    assert lines[2].startswith("20261201-101112-abcdef01 smoke")


def test_params_shows_only_the_params_that_differ_under_each_run():
    common = {"train.seed": 0, "model.name": "clipforge-tiny"}
    a = made_up("a", 30.0, params={**common, "train.lr": 0.001, "train.max_steps": None})
    b = made_up("b", 20.0, params={**common, "train.lr": 0.002, "train.max_steps": 20})
    c = made_up("c", 10.0, params={**common, "train.lr": 0.002, "data.num_train": 12})
    lines = format_runs([c, a, b], with_params=True)
    assert lines[1:6] == [
        lines[1],
        "  train.lr=0.001  train.max_steps=null",
        lines[3],
        "  train.lr=0.002  train.max_steps=20",
        lines[5],
    ]
    assert lines[6] == "  train.lr=0.002"  # data.num_train: one value only, no difference
    assert "train.seed" not in "\n".join(lines)
    same = format_runs([made_up("a", 30.0), made_up("b", 20.0)], with_params=True)
    assert "params: the same in every run" in same


def test_the_last_lines_point_at_the_commands_that_compare_the_top_two():
    experiments = format_runs([made_up("low", 1.0), made_up("high", 9.0), made_up("mid", 5.0)])
    assert experiments[-2:] == ["compare the top two:", "  dvc plots diff high mid"]
    fetched = [made_up(n, m, experiment=None, folder=n) for n, m in (("id-a", 1.0), ("id-b", 2.0))]
    assert format_runs(fetched)[-1] == "  fab compare id-b id-a"
    both = [made_up("x", 1.0, folder="x"), made_up("y", 2.0, folder="y")]
    assert format_runs(both)[-3:] == [
        "compare the top two:",
        "  dvc plots diff y x",
        "  fab compare y x",
    ]
    # a fetched smoke run's experiment, named by its launch id: the row's name, no comment
    smoke_id = "20261201-101112-abcdef01"
    smoke = made_up(smoke_id, 9.0, smoke=True, folder="x", experiment=f"{smoke_id}-smoke")
    assert format_runs([smoke, made_up("malar-eggs", 5.0)])[-1] == (
        f"  dvc plots diff {smoke_id}-smoke malar-eggs"
    )
    # one fetched before experiments took the launch id: named by DVC, tied to its row by a
    # comment, on its own line where the command and the comment would not fit together
    long_exp = made_up("20261201-101112-abcdef01", 9.0, folder="x", experiment="a" * 40)
    lines = format_runs([long_exp, made_up("gammy-prep", 5.0)])
    assert lines[-2:] == [
        f"  dvc plots diff {'a' * 40} gammy-prep",
        f"  # {'a' * 40}: 20261201-101112-abcdef01",
    ]
    mixed = format_runs([made_up("exp", 1.0), fetched[0]])
    assert "compare the top two:" not in mixed


def test_a_fetched_run_and_its_experiment_are_one_row_and_equal_results_once():
    launch = made_up("20261201-101112-abcdef01", 20.0, 1.0, experiment=None, folder="x")
    its_experiment = made_up("gammy-prep", 20.0, 1.0)
    demo, demo_again = made_up("demo", 30.0, 2.0), made_up("demo-again", 30.0, 2.0)
    workspace = made_up("workspace", 30.0, 2.0, folder=".")
    rows, left_out = merge([launch], [demo, demo_again, its_experiment, workspace])
    assert [(r.name, r.experiment) for r in rows] == [
        ("20261201-101112-abcdef01", "gammy-prep"),
        ("demo", "demo"),
    ]
    assert left_out == [
        "demo-again (the same results as demo)",
        "workspace (the same results as demo)",
    ]


def test_an_unknown_sort_metric_is_refused_with_the_names_it_takes():
    with pytest.raises(RunsError) as refused:
        format_runs([made_up("a", 1.0, 1.0)], "mean_recal")
    message = str(refused.value)
    assert "\n" not in message
    assert "--sort-by mean_recal: no run has that metric; did you mean test.mean_recall" in message
    assert message.endswith(
        ": mean_over_suites, test.mean_recall, t2i-distractors.mean_recall, colour-shape.top1"
    )


def test_dvc_exp_shows_json_gives_the_experiments_then_the_commits_then_the_workspace():
    def entry(rev: str, name: str | None, mean: float | None, lr: float) -> dict:
        metrics = {EVAL_FILE: {"data": eval_json(mean)} if mean else {"error": {"type": "x"}}}
        params = {"params.yaml": {"data": {"train": {"lr": 1, "seed": 0}}}}
        params["resolved/train.yaml"] = {"data": {"train": {"lr": lr}}}
        return {"rev": rev, "name": name, "data": {"metrics": metrics, "params": params}}

    shown = [
        {**entry("workspace", None, 30.0, 0.1), "experiments": None},
        {
            **entry("f" * 40, "main", 25.0, 0.1),
            "experiments": [
                {"name": "gammy-prep", "revs": [entry("a" * 40, "gammy-prep", 30.0, 0.2)]},
                {"name": None, "revs": [entry("b" * 40, None, 20.0, 0.3)]},
            ],
        },
        {**entry("e" * 40, None, None, 0.1), "experiments": None},  # no results: no row
    ]
    found = runs.from_experiments(shown)
    assert [(r.name, r.experiment, r.folder) for r in found] == [
        ("gammy-prep", "gammy-prep", None),
        ("bbbbbbb", "bbbbbbb", None),
        ("main", "main", None),
        ("workspace", "workspace", "."),
    ]
    assert found[0].params == {"train.lr": 0.2, "train.seed": 0}  # the resolved copy wins


def test_the_readmes_example_is_what_fab_runs_prints():
    """README.md's "Compare runs" shows the demo beside a fetched smoke run and its experiment."""
    example = re.search(r"^```\n(run .*?)^```", (REPO / "README.md").read_text(), re.M | re.S)
    assert example, "README.md: no example of fab runs"

    def scores(test: float, distractors: float, top1: float) -> dict:
        suites = {"test": test, "t2i-distractors": distractors, "colour-shape": top1}
        return {EVAL_FILE: eval_json((test + distractors + top1) / 3, suites)}

    demo = Run("malar-eggs", scores(36.417, 36.0, 25.667), {}, experiment="malar-eggs")
    smoke = Run(
        "20261201-101112-3f2a9c1e",
        scores(3.1, 2.5, 1.333),
        {},
        smoke=True,
        experiment="20261201-101112-3f2a9c1e-smoke",
        folder="20261201-101112-3f2a9c1e",
    )
    assert format_runs([smoke, demo]) == example[1].splitlines()


def test_fab_runs_without_runs_says_how_to_make_one(tmp_path):
    result = fab("runs", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "no runs here" in result.stderr and "make demo" in result.stderr
    assert "fab fetch --launch ID" in result.stderr


def fetched(runs_dir: Path, launch_id: str, mean: float, smoke: bool = False, lr: float = 0.001):
    """A run as `fab fetch` brings it: the stages' outputs, node 0's launch record."""
    path = make_run(runs_dir / launch_id, params={**PARAMS, "train": {"lr": lr, "seed": 0}})
    (path / EVAL_FILE).write_text(json.dumps(eval_json(mean)))
    (path / "node-0").mkdir()
    (path / "node-0" / "run.json").write_text(json.dumps({"launch_id": launch_id, "smoke": smoke}))
    return path


def test_fab_runs_lists_fetched_runs_best_first_within_80_columns(tmp_path, monkeypatch):
    fetched(tmp_path / "runs", "20261201-101112-abcdef01", 2.31, smoke=True, lr=0.01)
    fetched(tmp_path / "runs", "20261202-090000-abcdef02", 32.69)
    (tmp_path / "runs" / "20261203-000000-abcdef03" / "logs").mkdir(parents=True)  # logs only
    (tmp_path / "runs" / "20261204-000000-abcdef04" / "metrics").mkdir(parents=True)  # cut short
    monkeypatch.setenv("COLUMNS", "80")
    result = fab("runs", "--params", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80, result.stdout
    assert lines[1].split() == ["20261202-090000-abcdef02", "32.69", "16.34", "65.38", "32.69"]
    assert lines[2] == "  train.lr=0.001"
    assert lines[3].startswith("20261201-101112-abcdef01 smoke   2.31")
    assert lines[4] == "  train.lr=0.01"
    assert "  fab compare 20261202-090000-abcdef02 20261201-101112-abcdef01" in lines
    assert "20261203" not in result.stdout
    assert "(left out: runs/20261204-000000-abcdef04: not a finished run, missing" in lines
    # README's other two lines: the table alone, and best first by another metric
    plain = fab("runs", cwd=tmp_path)
    assert plain.returncode == 0 and plain.stdout.splitlines()[1] == lines[1], plain.stderr
    assert "train.lr=" not in plain.stdout
    by_test = fab("runs", "--sort-by", "test.mean_recall", cwd=tmp_path)
    assert by_test.returncode == 0, by_test.stderr
    assert "best first: highest test.mean_recall (--sort-by)" in " ".join(by_test.stdout.split())


def test_experiments_of_every_commit_are_listed_beside_a_fetched_run(tmp_path, monkeypatch):
    """A DVC repository with experiments on two commits (DVC lists HEAD's only), the workspace
    holding the newest one's results, and a fetched run whose experiment is among them."""
    from dvc.repo import Repo

    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.chdir(tmp_path)  # DVC takes include_untracked's paths from here
    git(tmp_path, "init", "--quiet")
    for key, value in (("user.name", "test"), ("user.email", "test@example.org")):
        git(tmp_path, "config", key, value)
    Repo.init(tmp_path).close()
    (tmp_path / "dvc.yaml").write_text(f"metrics:\n  - {TRAIN_FILE}\n  - {EVAL_FILE}\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "params.yaml").write_text("train:\n  lr: 0.001\n  seed: 0\n")
    git(tmp_path, "add", "--all")
    git(tmp_path, "commit", "--quiet", "-m", "pipeline")
    launch = fetched(tmp_path / "runs", "20261201-101112-abcdef01", 20.0)

    def experiment(name: str, lr: float, mean: float, like: Path | None = None) -> None:
        (tmp_path / "params.yaml").write_text(f"train:\n  lr: {lr}\n  seed: 0\n")
        made = {TRAIN_FILE: {"loss": 1.0, "val_loss": 2.0}, EVAL_FILE: eval_json(mean)}
        for file in (TRAIN_FILE, EVAL_FILE):
            (tmp_path / file).write_text(
                (like / file).read_text() if like else json.dumps(made[file])
            )
        with Repo(tmp_path) as repo:
            repo.experiments.save(name=name, force=True, include_untracked=[TRAIN_FILE, EVAL_FILE])

    experiment("low", 0.001, 10.0)
    experiment("gammy-prep", 0.001, 0.0, like=launch)  # `fab fetch` brought it
    (tmp_path / "README.md").write_text("a commit after the experiments\n")
    git(tmp_path, "add", "README.md")
    git(tmp_path, "commit", "--quiet", "-m", "later")
    experiment("high", 0.004, 30.0)
    lines: list[str] = []
    list_runs("mean_over_suites", True, lines.append, tmp_path / "runs", tmp_path)
    table = [line.split()[0] for line in lines[1:] if not line.startswith(" ")][:3]
    assert table == ["high", "20261201-101112-abcdef01", "low"], "\n".join(lines)
    assert "left out: workspace (the same results as high)" in lines
    assert lines[-2:] == [
        "compare the top two:",
        "  dvc plots diff high gammy-prep  # gammy-prep: 20261201-101112-abcdef01",
    ]
