"""`fab compare` (clipforge.repro.compare): causes first, then metrics, weights and a verdict."""

from __future__ import annotations

import json

from clipforge.repro.compare import DIFFERENT, IDENTICAL, WITHIN, compare, format_report
from clipforge.repro.run_folder import read_run
from tests.support.repro_runs import PARAMS, fab, make_run


def test_two_runs_with_the_same_weights_are_identical(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    result = compare(read_run(a), read_run(b))
    assert result.verdict == IDENTICAL and result.passed
    assert not result.params and result.data is None and not result.environment


def test_different_params_come_first_and_fail_the_verdict(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(
        tmp_path / "b",
        params={**PARAMS, "train": {"lr": 0.002, "seed": 0}},
        metrics={"loss": 1.25, "val_loss": 2.0},
        weights=b"other",
    )
    result = compare(read_run(a), read_run(b))
    assert result.verdict == DIFFERENT and not result.passed
    assert [(d.key, d.a, d.b) for d in result.params] == [("train.lr", 0.001, 0.002)]
    report = format_report(result)
    assert report.index("train.lr: 0.001 -> 0.002") < report.index("metrics:")
    assert "train.loss" in report and "-0.25" in report
    assert "weights: differ" in report


def test_a_stated_tolerance_accepts_small_metric_differences(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", metrics={"loss": 1.5001, "val_loss": 2.0}, weights=b"x")
    assert compare(read_run(a), read_run(b), tolerance=0.001).verdict == WITHIN
    assert compare(read_run(a), read_run(b), tolerance=0.00001).verdict == DIFFERENT
    # as README.md writes it: `fab compare A B --tolerance T`, exit 0 within the band
    assert fab("compare", str(a), str(b), "--tolerance", "0.5").returncode == 0
    assert fab("compare", str(a), str(b), "--tolerance", "0.00001").returncode == 1


def test_data_and_stack_differences_are_named(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", manifest="n" * 64)
    info_file = b / "metrics" / "train.info.json"
    info = json.loads(info_file.read_text())
    info["environment"]["stack"]["torch"] = "9.9.9"
    info_file.write_text(json.dumps(info))
    result = compare(read_run(a), read_run(b))
    assert result.data is not None and result.data.b == "n" * 64
    assert [d.key for d in result.environment] == ["stack.torch"]


def test_fab_compare_exits_0_on_identical_and_1_on_different(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    same = fab("compare", str(a), str(b))
    assert same.returncode == 0, same.stderr
    assert "verdict: identical" in same.stdout
    c = make_run(tmp_path / "c", params={**PARAMS, "train": {"lr": 0.01, "seed": 0}}, weights=b"y")
    other = fab("compare", str(a), str(c))
    assert other.returncode == 1
    assert other.stdout.splitlines()[3] == "params: 1 differs"
    assert "verdict: different" in other.stdout


def test_fab_compare_names_a_missing_run_in_one_line(tmp_path):
    result = fab("compare", str(tmp_path / "nope"), str(tmp_path / "nope"))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "no run there" in result.stderr
