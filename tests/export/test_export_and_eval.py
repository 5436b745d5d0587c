"""The exported model works in plain open_clip, and the eval stage measures it: for the fp32 run,
the bf16 runs (DeepSpeed's bf16 mode at ZeRO-1, autocast at ZeRO-2/3), and the fp32 weights read
from every kind of checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clipforge.data import testset
from clipforge.eval.core import encode_images, encode_texts
from clipforge.eval.stage import main as eval_main
from clipforge.export.card import NOT_EVALUATED
from clipforge.export.loading import load_open_clip
from clipforge.metrics.retrieval import METRIC_KEYS
from tests.conftest import (
    BF16_SETS,
    eval_argv,
    set_args,
    subprocess_env,
    train_argv,
    write_params,
)
from tests.support.checkpoint_weights_worker import CASES, case_name
from tests.support.plain_open_clip import assert_plain_recall_is_evals, plain_open_clip
from tests.support.workers import json_from

pytestmark = pytest.mark.slow


def test_export_loads_in_plain_open_clip_with_the_embeddings_eval_uses(
    reference_run, small_data, tmp_path
):
    model_dir = reference_run / "models" / "clip"
    plain = plain_open_clip(model_dir, small_data / "test", tmp_path / "plain.json")
    assert plain["dtypes"] == ["torch.float32"]

    model, preprocess, tokenizer = load_open_clip(f"local-dir:{model_dir}", None, "cpu")
    test_set = testset.load_test_set(small_data / "test")
    texts = [t.text for t in test_set.texts]
    torch.testing.assert_close(
        encode_images(model, preprocess, test_set.images, 4, "cpu"),
        torch.tensor(plain["image"]),
        rtol=1e-5,
        atol=1e-6,
    )
    torch.testing.assert_close(
        encode_texts(model, tokenizer, texts, 4, "cpu"),
        torch.tensor(plain["text"]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_a_bf16_run_exports_what_plain_open_clip_loads_with_evals_recall(
    bf16_run, small_data, tmp_path
):
    """The production numeric path end to end (data -> train -> export -> eval): bf16 at ZeRO-1,
    DeepSpeed's own bf16 mode, exports its fp32 master weights."""
    assert_plain_recall_is_evals(bf16_run / "models" / "clip", small_data / "test", tmp_path)


# ZeRO-3's run in make test-tier2 (~25 s more); make test keeps its layout read at one rank
# (test_the_export_reads_the_engines_own_fp32_weights_from_every_kind_of_checkpoint).
# Two more bf16 runs (40 s each): in make test-tier2. make test keeps the export of ZeRO-2's and
# ZeRO-3's bf16 shards read bit for bit (the test below) and the bf16 run above, end to end.
@pytest.mark.tier2
@pytest.mark.parametrize("stage", [2, 3])
def test_the_bf16_run_above_zero1_exports_too(tmp_path, small_data, stage):
    """The same run at ZeRO-2 and ZeRO-3 (fp32 weights under bf16 autocast, ZeRO's own shards),
    3 steps, in a fresh interpreter (a ZeRO-3 engine patches torch for its whole process)."""
    params = write_params(tmp_path / "params.yaml")
    sets = (*BF16_SETS, "train.max_steps=3", f"train.zero_stage={stage}")
    result = subprocess.run(
        [sys.executable, "-m", "clipforge.train", *train_argv(tmp_path, small_data, params)]
        + set_args(sets),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"bf16 ZeRO-{stage}" in result.stderr
    assert_plain_recall_is_evals(tmp_path / "models" / "clip", small_data / "test", tmp_path)


def _weights_worker(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"weights-{len(list(tmp_path.glob('weights-*')))}.json"
    worker = ["-m", "tests.support.checkpoint_weights_worker", str(out)]
    return json_from([*worker, str(tmp_path / "runs"), *args], out)


def _assert_the_engines_weights(compared: dict) -> None:
    """Each checkpoint compared: every parameter, the same names, bit for bit; a locked image
    tower's parameters (all 44 of clipforge-tiny's) those it started with."""
    for name, one in compared.items():
        assert one["only_engine"] == one["only_checkpoint"] == [], name
        assert one["num_params"] > 50, name
        assert one["max_diff"] == 0.0, name
        assert one["num_locked"] == (44 if "-locked" in name else 0), name
        assert one["locked_moved"] == [], name


def test_the_export_reads_the_engines_own_fp32_weights_from_every_kind_of_checkpoint(tmp_path):
    """Every optimizer layout the train stage writes (ZeRO-0's model states, ZeRO-1's shards and
    DeepSpeed's bf16 mode, ZeRO-2's and ZeRO-3's shards, and ZeRO-1's and ZeRO-3's with a locked
    image tower): what the export reads from each checkpoint is, bit for bit, the engine's own
    fp32 master weights, every parameter of them, and the locked ones as they started."""
    saved = _weights_worker(tmp_path, "--world", "1")
    assert list(saved) == [f"{case_name(*case)}-step-00000002" for case in CASES]
    assert saved["zero1-bf16-step-00000002"]["dtypes"] == ["torch.bfloat16"]  # the bf16 mode
    # not with a tower locked: fp32 weights under autocast, so that the locked ones stay exact
    assert saved["zero1-bf16-locked-step-00000002"]["dtypes"] == ["torch.float32"]
    _assert_the_engines_weights(saved)


# Two more interpreters, 2 ranks then 1, four universal conversions (~1 min): in make
# test-tier2. make test keeps each layout at one rank (above) and the shrink rule's unit tests
# (tests/train/test_fewer_ranks.py).
@pytest.mark.tier2
def test_the_same_on_two_ranks_and_after_a_universal_resume_on_one(tmp_path):
    """The same layouts saved by 2 ranks, then each resumed on 1 through DeepSpeed's universal
    checkpoint, as the train stage goes on with fewer GPUs, and saved again: the export reads the
    engine's own fp32 master weights from the 2 ranks' checkpoint (what was loaded) and from the
    one saved after."""
    saved = _weights_worker(tmp_path, "--world", "2")
    resumed = _weights_worker(tmp_path, "--world", "1", "--resume")
    cases = [case_name(*case) for case in CASES]
    assert list(saved) == [f"{case}-step-00000002" for case in cases]
    assert list(resumed) == [
        f"{case}-{step}" for case in cases for step in ("step-00000002-loaded", "step-00000003")
    ]
    _assert_the_engines_weights({**saved, **resumed})


def test_eval_stage_writes_metrics_with_the_documented_keys(
    reference_run, small_data, tmp_path, capsys
):
    params = write_params(tmp_path / "params.yaml")
    out = tmp_path / "metrics" / "eval.json"
    model = f"local-dir:{reference_run / 'models/clip'}"
    assert eval_main(eval_argv(params, model, small_data / "test", out)) == 0
    everything = json.loads(out.read_text())
    assert list(everything) == ["test", "mean_over_suites"]  # --data: one suite, named test
    metrics = everything["test"]
    assert list(metrics) == list(METRIC_KEYS)  # recall only: the counts are in eval.info.json
    assert all(0.0 <= metrics[key] <= 100.0 for key in METRIC_KEYS)
    assert metrics["t2i_r01"] <= metrics["t2i_r05"] <= metrics["t2i_r10"]
    assert everything["mean_over_suites"] == metrics["mean_recall"]
    info = json.loads((tmp_path / "metrics" / "eval.info.json").read_text())
    suite = info["suites"]["test"]
    assert (suite["num_images"], suite["num_texts"]) == (24, 48)
    assert info["model"] == model
    assert suite["decontamination"]["checked"] is False  # built-in data: disjoint when drawn
    assert (tmp_path / "metrics" / "eval.config.yaml").is_file()
    assert "t2i_r01" in capsys.readouterr().out  # the table
    # the export's card, written before any eval, with these metrics in it: what to publish
    card = (tmp_path / "metrics" / "model-card.md").read_text(encoding="utf-8")
    export_card = (reference_run / "models/clip/README.md").read_text(encoding="utf-8")
    assert NOT_EVALUATED in export_card and NOT_EVALUATED not in card
    assert f"- test: t2i_r01 {metrics['t2i_r01']:.4g}," in card
    assert f"- mean_over_suites: value {everything['mean_over_suites']:.4g}" in card
    assert card.startswith(export_card.split(NOT_EVALUATED)[0])  # the rest of the card as it was


def test_baseline_model_adds_its_numbers_and_the_delta(reference_run, small_data, tmp_path):
    model = f"local-dir:{reference_run / 'models/clip'}"
    params = write_params(tmp_path / "params.yaml", {"eval": {"baseline_model": model}})
    out = tmp_path / "eval.json"
    assert eval_main(eval_argv(params, model, small_data / "test", out)) == 0
    metrics = json.loads(out.read_text())
    assert metrics["baseline"]["test"] == metrics["test"]  # the same model twice
    assert json.loads((tmp_path / "eval.info.json").read_text())["baseline"]["model"] == model
    assert metrics["delta"]["test"]["mean_recall"] == 0.0
    assert metrics["delta"]["mean_over_suites"] == 0.0


def test_eval_on_a_missing_model_or_test_set_is_a_clear_error(tmp_path, small_data, capsys):
    params = write_params(tmp_path / "params.yaml")
    missing = f"local-dir:{tmp_path / 'none'}"
    assert eval_main(eval_argv(params, missing, small_data / "test", tmp_path / "e.json")) == 2
    assert "run the train stage first" in capsys.readouterr().err
    assert eval_main(["--params", str(params), "--data", str(tmp_path)]) == 2
    assert "test_imgs.tsv not found" in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()


def test_an_architecture_name_needs_its_pretrained_weights(tmp_path, small_data, capsys):
    """`--model ViT-B-32` alone would evaluate random weights: refused in one line naming
    --pretrained and the tags open_clip has for it; nothing written."""
    params = write_params(tmp_path / "params.yaml")
    out = tmp_path / "e.json"
    argv = ["--params", str(params), "--data", str(small_data / "test"), "--out", str(out)]
    assert eval_main([*argv, "--model", "ViT-B-32"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--pretrained" in err and "openai" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_pretrained_weights_file_is_evaluated(reference_run, small_data, tmp_path):
    """`--model NAME --pretrained FILE` loads that file into the architecture: the trained
    weights give the same recall as the exported model they come from."""
    params = write_params(tmp_path / "params.yaml")
    argv = ["--params", str(params), "--data", str(small_data / "test")]
    exported = reference_run / "models" / "clip"
    model_cfg = json.loads((exported / "open_clip_config.json").read_text())["model_cfg"]
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-32.json").write_text(json.dumps(model_cfg))
    import open_clip

    open_clip.add_model_config(tmp_path / "configs" / "tiny-32.json")
    weights = exported / "open_clip_model.safetensors"
    by_name = tmp_path / "by-name.json"
    assert (
        eval_main(
            [*argv, "--model", "tiny-32", "--pretrained", str(weights), "--out", str(by_name)]
        )
        == 0
    )
    by_dir = tmp_path / "by-dir.json"
    assert eval_main([*argv, "--model", f"local-dir:{exported}", "--out", str(by_dir)]) == 0
    assert json.loads(by_name.read_text()) == json.loads(by_dir.read_text())
    assert json.loads((tmp_path / "by-name.info.json").read_text())["pretrained"] == str(weights)


def test_weights_that_cannot_be_downloaded_are_one_line(tmp_path, small_data):
    """Pretrained weights neither cached nor downloadable (here the hub is offline): one line
    saying so and what to do, exit 2, no retry noise, no traceback, nothing written."""
    params = write_params(tmp_path / "params.yaml")
    out = tmp_path / "e.json"
    env = {**subprocess_env(), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipforge.eval",
            "--params",
            str(params),
            "--model",
            "ViT-B-32",
            "--pretrained",
            "openai",
            "--data",
            str(small_data / "test"),
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "ViT-B-32 with pretrained openai" in lines[0] and "could not be downloaded" in lines[0]
    assert not out.exists()
