"""The real DVC pipeline in a temporary git repository: repro, no-op repro, metrics, plots, exps."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env, write_params
from tests.test_readme_commands import documented_commands

pytestmark = pytest.mark.slow

TINY = {
    "data": {"num_train": 96, "num_val": 16, "num_test_images": 12},
    "train": {"epochs": 1, "save_every_steps": 2},
}


def _dvc(repo: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = subprocess_env()
    env["PYTHONPATH"] = str(repo / "src")  # the copied code, as in a fresh clone
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    result = subprocess.run(
        ["dvc", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"dvc {' '.join(args)}:\n{result.stdout}\n{result.stderr}"[
        -4000:
    ]
    return result


@pytest.fixture(scope="module")
def pipeline_repo(tmp_path_factory) -> Path:
    """A clone-like git repository with the project's pipeline files and code, after `dvc repro`
    and a commit of its results."""
    repo = tmp_path_factory.mktemp("pipeline")
    for name in ("dvc.yaml", ".dvcignore"):
        shutil.copy(REPO / name, repo / name)
    shutil.copytree(REPO / ".dvc", repo / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"))
    shutil.copytree(REPO / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__"))
    write_params(repo / "params.yaml", TINY)
    (repo / ".gitignore").write_text((REPO / ".gitignore").read_text())
    for command in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"],
    ):
        subprocess.run(command, cwd=repo, check=True)
    _dvc(repo, "repro")
    # committed as DVC asks: dvc.lock, the resolved params, the metrics
    for command in (
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "repro"],
    ):
        subprocess.run(command, cwd=repo, check=True)
    return repo


def test_repro_runs_data_train_eval_and_writes_the_documented_layout(pipeline_repo):
    for path in (
        "data/manifest.json",
        "data/train",
        "data/val",
        "data/test/test_imgs.tsv",
        "data/test/test_texts.jsonl",
        "models/clip/open_clip_config.json",
        "models/clip/open_clip_model.safetensors",
        "metrics/train.tsv",
        "metrics/val.tsv",
        "metrics/train.json",
        "metrics/train.info.json",
        "metrics/eval.json",
        "metrics/eval.info.json",
        "metrics/model-card.md",
        "resolved/train.yaml",
        "dvc.lock",
    ):
        assert (pipeline_repo / path).exists(), path
    assert any((pipeline_repo / "checkpoints").iterdir())
    assert any((pipeline_repo / "logs").iterdir())
    lock = (pipeline_repo / "dvc.lock").read_text()
    assert all(f"  {stage}:" in lock for stage in ("params-train", "data", "train", "eval"))


def test_second_repro_runs_nothing(pipeline_repo):
    result = _dvc(pipeline_repo, "repro")
    assert "Running stage" not in result.stdout
    assert "up to date" in result.stdout.lower()


def test_metrics_show_compares_models_only_with_recall_in_order(pipeline_repo):
    """`dvc metrics show`: every suite's recall or accuracy under its name, the mean over
    suites and the final losses, no bookkeeping; DVC sorts the columns, and the names make that
    R@1, R@5, R@10. With 12 test images, t2i-distractors has 6 captions: its flag shows too."""
    table = _dvc(pipeline_repo, "metrics", "show").stdout
    header = table.splitlines()[0].split()
    assert header == [
        "Path",
        "colour-shape.top1",
        "colour-shape.top5",
        "logit_scale",
        "loss",
        "mean_over_suites",
        "t2i-distractors.mean_recall",
        "t2i-distractors.t2i_few_queries",
        "t2i-distractors.t2i_r01",
        "t2i-distractors.t2i_r05",
        "t2i-distractors.t2i_r10",
        "test.i2t_r01",
        "test.i2t_r05",
        "test.i2t_r10",
        "test.mean_recall",
        "test.t2i_r01",
        "test.t2i_r05",
        "test.t2i_r10",
        "val_loss",
    ]


def test_plots_are_the_declared_curves_only(pipeline_repo, tmp_path):
    """`dvc plots show`: train and val loss, val recall, lr and throughput, against the step; no
    chart DVC would add by itself."""
    shown = json.loads(_dvc(pipeline_repo, "plots", "show", "--json").stdout)["data"]
    assert list(shown) == ["loss", "val_recall", "learning_rate", "throughput"]
    _dvc(pipeline_repo, "plots", "show", "--out", str(tmp_path / "plots"))
    html = (tmp_path / "plots" / "index.html").read_text()
    assert "val_recall" in html and "mean_recall" in html


def test_exp_run_with_a_changed_param_reruns_train_and_eval_only(pipeline_repo):
    result = _dvc(pipeline_repo, "exp", "run", "-S", "train.lr=5e-4")
    assert "Running stage 'train'" in result.stdout and "Running stage 'eval'" in result.stdout
    assert "Running stage 'data'" not in result.stdout
    shown = json.dumps(json.loads(_dvc(pipeline_repo, "exp", "show", "--json").stdout))
    assert "0.0005" in shown and "t2i_r01" in shown  # the experiment's params and its metrics


def test_a_new_model_leaves_the_data_stage_up_to_date_a_new_pretokenize_model_does_not(
    pipeline_repo,
):
    """The data stage's params are the data section alone: a new model.name (another tokenizer)
    leaves data/ as it is (the loader then tokenises, or reads ids of the same tokenizer), while
    a new data.pretokenize_model (the tokenizer of the stored ids) makes it stale."""
    import yaml

    params = pipeline_repo / "params.yaml"
    original = params.read_text()
    try:
        for section, key, value, stale in (
            ("model", "name", "ViT-B-32", False),
            ("data", "pretokenize_model", "ViT-B-32", True),
        ):
            edited = yaml.safe_load(original)
            edited[section][key] = value
            params.write_text(yaml.safe_dump(edited, allow_unicode=True))
            _dvc(pipeline_repo, "repro", "params-data")
            status = _dvc(pipeline_repo, "status", "data").stdout
            # dvc names the changed param (the whole `data` section) under resolved/data.yaml
            assert ("resolved/data.yaml" in status) == stale, status
            assert ("up to date" in status) != stale, status
    finally:
        subprocess.run(["git", "checkout", "--", "."], cwd=pipeline_repo, check=True)


def test_an_alerts_default_and_a_store_setting_leave_the_data_stage_up_to_date(pipeline_repo):
    """Editing an alert's default in its code and the run store's settings in params.yaml makes
    the train stage's params stale, and nothing of the data stage: not its params stage (which
    depends on the data section and its code only), not the data."""
    import yaml

    alerts = pipeline_repo / "src" / "clipforge" / "alerts" / "config.py"
    params = pipeline_repo / "params.yaml"
    try:
        text = alerts.read_text()
        edited = text.replace(
            "        3.0, \"Alert when a step's loss", "        4.0, \"Alert when a step's loss"
        )
        assert edited != text
        alerts.write_text(edited)
        values = yaml.safe_load(params.read_text())
        values["storage"]["keep_checkpoints"] = 5
        params.write_text(yaml.safe_dump(values, allow_unicode=True))
        stale = json.loads(_dvc(pipeline_repo, "status", "--json").stdout)
        assert "params-train" in stale and "train" in stale
        assert not {"data", "params-data"} & set(stale), stale
    finally:
        subprocess.run(["git", "checkout", "--", "."], cwd=pipeline_repo, check=True)


def _cells(row: str) -> list[str]:
    return re.split(r"\s{2,}", row.strip())


def test_the_documented_comparisons_fit_80_columns_and_sort_best_first(pipeline_repo, monkeypatch):
    """Each `dvc exp show` line of README.md and docs/pipeline.md, as written, at COLUMNS=80:
    every kept column shown (none behind `…`), and a --sort-by line lists the experiments best
    first. Two experiments beside the others, their mean over suites set by hand, make the order
    known. Before the recipe's experiment, whose dozen changed params are wider than 80."""
    documented = {
        tuple(argv)
        for doc in ("README.md", "docs/pipeline.md")
        for argv in documented_commands(doc)
        if argv[:3] == ["dvc", "exp", "show"]
    }
    eval_json = pipeline_repo / "metrics" / "eval.json"
    try:
        for name, mean in (("worst", 0.5), ("best", 99.5)):
            eval_json.write_text(
                json.dumps({**json.loads(eval_json.read_text()), "mean_over_suites": mean})
            )
            _dvc(pipeline_repo, "exp", "save", "--force", "--name", name, "eval")
    finally:
        subprocess.run(["git", "checkout", "--", "."], cwd=pipeline_repo, check=True)
    monkeypatch.setenv("COLUMNS", "80")
    for argv in sorted(documented):
        table = _dvc(pipeline_repo, *argv[1:]).stdout
        assert max(map(len, table.splitlines())) <= 80 and "…" not in table, table
        if "--sort-by" not in argv:
            continue
        sort_by = argv[argv.index("--sort-by") + 1]
        header, *rows = [_cells(r) for r in table.splitlines() if r.strip().strip("─")]
        experiments = [row for row in rows if re.match(r"[├└]── ", row[0])]
        values = [float(row[header.index(sort_by)]) for row in experiments]
        assert len(values) >= 2 and values == sorted(values, reverse=True), table
        if sort_by == "mean_over_suites":
            assert "[best]" in experiments[0][0] and "[worst]" in experiments[-1][0], table


def test_a_recipe_written_into_params_yaml_is_what_the_experiment_shows(pipeline_repo):
    """`python -m clipforge.pipeline.recipe production`, then `dvc exp run` (its params stage
    only): `dvc params diff` shows the recipe's lr, precision and ranks in params.yaml itself and
    in the resolved params, the same values, and `dvc exp show` carries them."""
    env = subprocess_env()
    env["PYTHONPATH"] = str(pipeline_repo / "src")
    command = [sys.executable, "-m", "clipforge.pipeline.recipe", "production"]
    subprocess.run(command, cwd=pipeline_repo, env=env, check=True, capture_output=True)
    _dvc(pipeline_repo, "exp", "run", "params-train")
    try:
        diff = json.loads(_dvc(pipeline_repo, "params", "diff", "--json").stdout)
        for file in ("params.yaml", "resolved/train.yaml"):
            changed = {k: (v["old"], v["new"]) for k, v in diff[file].items()}
            assert changed["train.lr"] == (0.001, 0.0005)
            assert changed["train.precision"] == ("auto", "bf16")
            assert changed["train.ranks_per_node"] == (1, 4)
        shown = json.loads(_dvc(pipeline_repo, "exp", "show", "--json").stdout)
        assert "'precision': 'bf16'" in str(shown) and "'lr': 0.0005" in str(shown)
    finally:
        subprocess.run(["git", "checkout", "--", "."], cwd=pipeline_repo, check=True)


def test_a_rerun_of_train_keeps_every_logged_step_once(pipeline_repo):
    """The curves are the run's record: `dvc repro` of train after a crash resumes from the
    newest checkpoint with the curve up to it kept (DVC deletes a stage's outputs before it runs
    it unless they persist) and the steps after it logged again, each once."""
    tsv = pipeline_repo / "metrics" / "train.tsv"
    before = [line.split("\t")[0] for line in tsv.read_text().splitlines()[1:]]
    assert len(before) >= 2
    # the run the curve is of (earlier tests of the module may have left others beside it)
    header, *rows = (line.split("\t") for line in tsv.read_text().splitlines())
    run_dir = pipeline_repo / "checkpoints" / rows[-1][header.index("run_id")]
    steps = sorted(p for p in run_dir.iterdir() if p.name.startswith("step-"))
    assert len(steps) >= 2
    # the crash: the newest checkpoint never saved, the run resumes from the one before
    shutil.rmtree(steps[-1])
    (run_dir / "latest").write_text(steps[-2].name + "\n")
    resumed_from = int(steps[-2].name.split("-")[1])
    try:
        _dvc(pipeline_repo, "repro", "--force", "--single-item", "train")
        after = [line.split("\t") for line in tsv.read_text().splitlines()[1:]]
        assert [row[0] for row in after] == before
        assert resumed_from < int(before[-1])
        info = json.loads((pipeline_repo / "metrics" / "train.info.json").read_text())
        assert info["resumed_from_step"] == resumed_from
    finally:
        subprocess.run(["git", "checkout", "--", "."], cwd=pipeline_repo, check=True)
