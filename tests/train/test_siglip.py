"""SigLIP's loss (train.loss: siglip, open_clip's SigLipLoss): the model starts with SigLIP's
learned bias and temperature, the accumulated gradient is the big batch's, and a run exports a
model that plain open_clip loads with its trained bias and the eval stage scores.

The two-rank gradient grid (ZeRO-1 and ZeRO-3) is in test_accumulation.py (tier2), exact resume
after a SIGKILL in test_resume.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from clipforge.fields import ConfigError
from clipforge.model.config import ModelConfig
from clipforge.model.factory import build_model
from clipforge.model.files import ModelFilesError
from clipforge.pipeline.params import load_pipeline_params
from tests.conftest import run_train
from tests.support.plain_open_clip import assert_plain_recall_is_evals, plain_open_clip
from tests.support.workers import json_from

WEIGHTS = "open_clip_model.safetensors"
FP32_RTOL = 1e-5  # as test_accumulation.py: |accumulated - big batch| / max |big batch|


def test_a_loss_other_than_clip_or_siglip_is_one_line():
    with pytest.raises(ConfigError) as refused:
        load_pipeline_params(None, ["train.loss=sigmoid"])
    assert str(refused.value) == "train.loss: got 'sigmoid'; allowed: clip, siglip"


def test_a_siglip_architecture_under_clips_loss_is_refused_before_it_is_built():
    """open_clip's *-SigLIP configs set a learned bias, which ClipLoss has no argument for: the
    train stage refuses the pair in one line naming both knobs, before building the model."""
    with pytest.raises(ConfigError) as refused:
        build_model(ModelConfig(name="ViT-B-16-SigLIP"), "clip")
    assert str(refused.value) == (
        "model.name: ViT-B-16-SigLIP is a SigLIP model (its config sets a learned bias), which "
        "train.loss: clip has no place for; set train.loss: siglip, or another model.name"
    )


def test_a_siglip_model_starts_at_siglips_temperature_and_bias_and_exports_them():
    """open_clip's init_logit_bias: the model has a logit_bias parameter at -10, its temperature
    starts at 10 (SigLIP's, not CLIP's 1/0.07), and the config the export writes builds both."""
    bundle = build_model(ModelConfig(image_size=32), "siglip")
    assert bundle.model.logit_bias.item() == -10.0
    assert bundle.model.logit_scale.exp().item() == pytest.approx(10.0)
    assert bundle.model_cfg["init_logit_bias"] == -10.0
    assert bundle.model_cfg["init_logit_scale"] == pytest.approx(math.log(10))
    out = bundle.model(torch.zeros(2, 3, 32, 32), bundle.tokenizer(["a", "b"]))
    assert out["logit_bias"].item() == -10.0  # what the step passes to SigLipLoss


def test_clip_weights_start_a_siglip_run_with_the_bias_at_0(untrained_model_dir):
    """Open weights are mostly CLIP's: model.pretrained fills every parameter it has, and the
    bias it lacks starts at 0, as open_clip's load_checkpoint sets it (its issue 712)."""
    start = load_file(str(untrained_model_dir / WEIGHTS))
    assert "logit_bias" not in start
    cfg = ModelConfig(image_size=32, pretrained=f"local-dir:{untrained_model_dir}")
    model = build_model(cfg, "siglip").model
    state = model.state_dict()
    assert [name for name in start if not torch.equal(state[name], start[name])] == []
    assert model.logit_bias.item() == 0.0


def test_siglip_weights_under_clips_loss_are_refused_naming_the_knob(tmp_path):
    weights = tmp_path / WEIGHTS
    save_file(build_model(ModelConfig(image_size=32), "siglip").model.state_dict(), str(weights))
    with pytest.raises(ModelFilesError, match="holds SigLIP's logit_bias.*set train.loss: siglip"):
        build_model(ModelConfig(image_size=32, pretrained=str(weights)))


@pytest.mark.slow
def test_accumulated_siglip_gradient_of_every_parameter_equals_the_big_batch_gradient(tmp_path):
    """One rank, ZeRO-1, 4 micro-batches of 4 against one batch of 16: every gradient, the bias's
    and the temperature's included, is the big batch's to fp32 precision, so every pair of the
    batch counted once (the plain mean of 4 micro-batch losses would miss 3/4 of the pairs)."""
    out = tmp_path / "result.json"
    worker = ["-m", "tests.support.gradient_worker", str(out)]
    outcome = json_from([*worker, "--loss", "siglip", "--stages", "1", "--accum", "1", "4"], out)
    for k in (1, 4):
        case = outcome[f"zero1-k{k}"]
        assert case["num_params"] > 50
        assert case["mismatched"] == [], (k, case)
        assert case["logit_bias_error"] < FP32_RTOL, (k, case)
        assert case["logit_scale_error"] < FP32_RTOL, (k, case)


@pytest.mark.slow
def test_a_siglip_run_exports_a_model_plain_open_clip_loads_with_its_trained_bias(
    siglip_run, small_data, tmp_path
):
    """The train stage with train.loss: siglip in DeepSpeed's bf16 mode (accumulation 2) exports
    open_clip's local-dir folder whose config builds the bias and whose weights hold it, 0-dim as
    open_clip's: the fp32 master's, which learned (DeepSpeed 0.19 had cleared its gradient, see
    train/engine.py); plain open_clip loads it strictly with the trained bias, and the eval stage
    scores it as plain open_clip does; TensorBoard shows the bias step by step. No transformers
    folder: the card says why."""
    model_dir = siglip_run / "models" / "clip"
    config = json.loads((model_dir / "open_clip_config.json").read_text())
    assert config["model_cfg"]["init_logit_bias"] == -10.0
    weights = load_file(str(model_dir / WEIGHTS))
    assert weights["logit_bias"].shape == weights["logit_scale"].shape == ()
    trained_bias = weights["logit_bias"].item()
    assert trained_bias != -10.0  # it learned

    plain = assert_plain_recall_is_evals(model_dir, small_data / "test", tmp_path)
    assert plain["logit_bias"] == trained_bias

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log_dir,) = (siglip_run / "logs").iterdir()
    logged = EventAccumulator(str(log_dir)).Reload().Scalars("train/logit_bias")
    assert [e.step for e in logged] == [1, 2, 3, 4, 5, 6]  # beside the temperature
    # the bf16 weight the forward used: 6 steps of lr 1e-3 are below its spacing of 1/16 at 10
    assert [e.value for e in logged] == [-10.0] * 6

    summary = json.loads((siglip_run / "metrics" / "train.json").read_text())
    assert math.isfinite(summary["loss"]) and math.isfinite(summary["val_loss"])
    assert not (model_dir / "transformers").exists()
    assert "SiglipModel" in (model_dir / "README.md").read_text(encoding="utf-8")


@pytest.mark.slow
def test_a_siglip_run_from_a_clip_export_exports_what_plain_open_clip_loads(
    untrained_model_dir, small_data, tmp_path
):
    """Open weights, as users start: a CLIP model's export as model.pretrained, trained with
    SigLIP's loss (3 steps), exports a folder plain open_clip loads strictly, with the bias it
    learned from 0."""
    sets = (f"model.pretrained=local-dir:{untrained_model_dir}", "train.loss=siglip")
    assert run_train(tmp_path, small_data, *sets, "train.max_steps=3") == 0
    model_dir = tmp_path / "models" / "clip"
    plain = plain_open_clip(model_dir, small_data / "test", tmp_path / "plain.json")
    assert plain["logit_bias"] == load_file(str(model_dir / WEIGHTS))["logit_bias"].item()
    assert plain["logit_bias"] not in (0.0, -10.0)
