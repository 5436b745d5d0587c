"""The exported model works in plain open_clip, and the eval stage measures it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from clipforge.data import testset
from clipforge.eval.core import encode_images, encode_texts
from clipforge.eval.loading import load_open_clip
from clipforge.eval.stage import main as eval_main
from clipforge.export.card import NOT_EVALUATED
from clipforge.metrics.retrieval import METRIC_KEYS
from tests.conftest import eval_argv, subprocess_env, write_params

pytestmark = pytest.mark.slow

# Runs in a separate interpreter where importing clipforge is impossible: what a user without
# clipforge installed gets from open_clip alone.
PLAIN_OPEN_CLIP = r"""
import sys, io, json, base64
sys.modules["clipforge"] = None  # any `import clipforge...` now raises ImportError
import open_clip, torch
from PIL import Image
model_dir, test_dir, out = sys.argv[1:4]
model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + model_dir)
tokenizer = open_clip.get_tokenizer("local-dir:" + model_dir)
model.eval()
lines = open(test_dir + "/test_imgs.tsv").read().splitlines()[:8]
images = torch.stack([preprocess(Image.open(io.BytesIO(base64.b64decode(l.split("\t")[1]))).convert("RGB"))
                      for l in lines])
texts = [json.loads(l)["text"] for l in open(test_dir + "/test_texts.jsonl").read().splitlines()[:8]]
with torch.no_grad():
    result = {"image": model.encode_image(images, normalize=True).tolist(),
              "text": model.encode_text(tokenizer(texts), normalize=True).tolist()}
json.dump(result, open(out, "w"))
"""


def test_export_loads_in_plain_open_clip_with_the_embeddings_eval_uses(
    reference_run, small_data, tmp_path
):
    model_dir = reference_run / "models" / "clip"
    out = tmp_path / "plain.json"
    result = subprocess.run(
        [sys.executable, "-c", PLAIN_OPEN_CLIP, str(model_dir), str(small_data / "test"), str(out)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    plain = json.loads(out.read_text())

    model, preprocess, tokenizer = load_open_clip(f"local-dir:{model_dir}", None, "cpu")
    test_set = testset.load_test_set(small_data / "test")
    images, texts = test_set.images[:8], [t.text for t in test_set.texts][:8]
    torch.testing.assert_close(
        encode_images(model, preprocess, images, 4, "cpu"),
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
