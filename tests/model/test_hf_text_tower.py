"""A Hugging Face text tower end to end: a tiny Chinese BERT-style tokenizer and model built here
(the layout of hfl/chinese-roberta-wwm-ext: config.json, weights, vocab.txt), trained for a few
steps by the real train stage with periodic validation, exported, and loaded by plain open_clip."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import subprocess_env, train_argv, write_params
from tests.support.hf_tower import make_tiny_chinese_tower

pytestmark = pytest.mark.slow

STEPS, VAL_EVERY = 4, 2
CAPTION = "左上角有一个红色的圆形"

# A separate interpreter where clipforge cannot be imported: what a user has with open_clip alone.
PLAIN_OPEN_CLIP = r"""
import sys, json
sys.modules["clipforge"] = None
import open_clip, torch
model_dir, caption = sys.argv[1:3]
model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + model_dir)
tokenizer = open_clip.get_tokenizer("local-dir:" + model_dir)
model.eval()
tokens = tokenizer([caption])
with torch.no_grad():
    text = model.encode_text(tokens, normalize=True)
    image = model.encode_image(torch.zeros(1, 3, 32, 32), normalize=True)
print(json.dumps({"tower": type(model.text).__name__, "tokens": tokens[0].tolist(),
                  "text_norm": text.norm().item(), "image_dim": image.shape[1]}))
"""


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, small_data):
    root = tmp_path_factory.mktemp("hf-tower")
    tower = make_tiny_chinese_tower(root / "tiny-chinese-bert")
    params = write_params(root / "params.yaml")
    command = [
        sys.executable,
        "-m",
        "clipforge.train",
        *train_argv(root, small_data, params),
        "--set",
        f"model.text_tower={tower}",
        "--set",
        f"train.max_steps={STEPS}",
        "--set",
        f"train.val_every_steps={VAL_EVERY}",
    ]
    result = subprocess.run(
        command, cwd=root, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "tower": tower, "model": root / "models" / "clip"}


def test_plain_open_clip_loads_the_export_with_its_chinese_tokenizer(hf_run):
    """local-dir: export -> open_clip builds the HF tower and the tokenizer knows the characters."""
    from transformers import AutoTokenizer

    result = subprocess.run(
        [sys.executable, "-c", PLAIN_OPEN_CLIP, str(hf_run["model"]), CAPTION],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    expected = AutoTokenizer.from_pretrained(str(hf_run["tower"]))(CAPTION)["input_ids"]
    assert loaded["tower"] == "HFTextEncoder"
    assert loaded["tokens"][: len(expected)] == expected and 1 not in expected  # 1 = [UNK]
    assert abs(loaded["text_norm"] - 1.0) < 1e-5


def test_training_updates_the_hf_tower_weights(hf_run):
    """The exported BERT weights differ from the tower's initial ones: gradients reached it."""
    from safetensors.torch import load_file

    exported = load_file(str(hf_run["model"] / "open_clip_model.safetensors"))
    initial = load_file(str(hf_run["tower"] / "model.safetensors"))
    name = "embeddings.word_embeddings.weight"
    assert exported[f"text.transformer.{name}"].shape == initial[name].shape
    assert not torch.allclose(exported[f"text.transformer.{name}"], initial[name])


def test_validation_recall_is_logged_every_val_every_steps(hf_run):
    """TensorBoard gets val/t2i_r01 ... val/mean_recall at steps 2 and 4 (val_every_steps=2)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (hf_run["root"] / "logs").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("val/loss", "val/t2i_r01", "val/t2i_r05", "val/i2t_r01", "val/mean_recall"):
        assert tag in tags
        assert [e.step for e in events.Scalars(tag)] == list(range(VAL_EVERY, STEPS + 1, VAL_EVERY))
    assert all(0.0 <= e.value <= 100.0 for e in events.Scalars("val/t2i_r01"))
