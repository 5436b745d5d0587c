"""Locked towers (train.lock_*, open_clip's lock_image_tower and lock_text_tower): what the
optimizer holds, what a run exports, and the locks refused before any model is built.

The ZeRO layouts with a locked tower (ZeRO-1 in bf16, ZeRO-3) are read back bit for bit by
tests/export/test_export_and_eval.py's checkpoint cases."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from clipforge.fields import ConfigError
from clipforge.model.config import ModelConfig
from clipforge.model.factory import build_model
from clipforge.pipeline.params import load_pipeline_params
from clipforge.train.config import TrainConfig
from clipforge.train.optim import lock_towers, param_groups
from clipforge.train.stage import main as train_main
from tests.conftest import run_train, write_params
from tests.support.hf_tower import make_tiny_chinese_tower

WEIGHTS = "open_clip_model.safetensors"


def test_the_optimizer_gets_every_trainable_parameter_once_and_no_locked_one():
    """A locked image tower with its last group (the projection) unlocked, and a text tower
    with its last two: the parameter groups DeepSpeed's optimizer is built from hold exactly
    the parameters left to train, weight decay on the same ones as without locks."""
    model = build_model(ModelConfig()).model
    train = TrainConfig(
        lock_image=True, lock_image_unlocked_groups=1, lock_text=True, lock_text_unlocked_layers=2
    )
    locked = lock_towers(model, train)
    names = {id(p): n for n, p in model.named_parameters()}
    grouped = [names[id(p)] for group in param_groups(model, 0.2) for p in group["params"]]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(grouped) == sorted(trainable)  # each once, none locked
    assert "visual.proj" in trainable and "visual.conv1.weight" not in trainable
    assert "text_projection" in trainable and "ln_final.weight" in trainable
    assert "token_embedding.weight" not in trainable and "logit_scale" in trainable
    assert locked["image"] == sum(
        p.numel()
        for n, p in model.named_parameters()
        if n.startswith("visual.") and n != "visual.proj"
    )
    decayed = {names[id(p)] for p in param_groups(model, 0.2)[0]["params"]}
    assert "visual.proj" in decayed and "transformer.resblocks.2.mlp.c_fc.weight" in decayed
    assert "logit_scale" not in decayed and "ln_final.weight" not in decayed


def test_a_hugging_face_tower_locked_keeps_its_layer_norms_training_when_asked(tmp_path):
    """lock_text_freeze_layer_norm: false, which open_clip's own text tower refuses, is open_clip's
    HFTextEncoder.lock: the tower locked but its LayerNorms, its projection (outside the tower)
    training."""
    tower = make_tiny_chinese_tower(tmp_path / "tower")
    sets = ["train.lock_text=true", "train.lock_text_freeze_layer_norm=false"]
    config = load_pipeline_params(None, [f"model.text_tower={tower}", *sets])
    model = build_model(config.model).model
    lock_towers(model, config.train)
    trainable = {
        n for n, p in model.named_parameters() if n.startswith("text.") and p.requires_grad
    }
    layer_norms = {n for n in trainable if ".LayerNorm." in n}
    assert layer_norms and trainable - layer_norms == {"text.proj.weight"}
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith("visual."))


@pytest.mark.slow
def test_a_locked_image_tower_exports_its_start_weights_bit_for_bit(
    untrained_model_dir, small_data, tmp_path
):
    """LiT from a weights file: a run with train.lock_image (ZeRO-1, the default) exports every
    `visual.*` tensor exactly as model.pretrained gave it, while the text tower and the
    temperature trained; rerun, it resumes from its checkpoint, locked tower and all, to the
    same export."""
    start = load_file(str(untrained_model_dir / WEIGHTS))
    sets = (
        f"model.pretrained=local-dir:{untrained_model_dir}",
        "train.lock_image=true",
        "train.max_steps=3",
    )
    assert run_train(tmp_path, small_data, *sets) == 0
    exported = load_file(str(tmp_path / "models" / "clip" / WEIGHTS))
    assert exported.keys() == start.keys()
    image = [name for name in start if name.startswith("visual.")]
    assert len(image) == 44
    assert [n for n in image if not torch.equal(exported[n], start[n])] == []
    text = [name for name in start if name.startswith(("transformer.", "token_embedding."))]
    assert all(not torch.equal(exported[n], start[n]) for n in text)
    assert not torch.equal(exported["logit_scale"], start["logit_scale"])

    assert run_train(tmp_path, small_data, *sets) == 0
    info = json.loads((tmp_path / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == 3
    again = load_file(str(tmp_path / "models" / "clip" / WEIGHTS))
    assert all(torch.equal(again[n], exported[n]) for n in exported)


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (
            ["train.lock_image=true", "train.lock_image_unlocked_groups=-1"],
            "train.lock_image_unlocked_groups: got -1; must be >= 0",
        ),
        (
            ["train.lock_text_unlocked_layers=2"],
            "train.lock_text_unlocked_layers: 2 does nothing while train.lock_text is false; "
            "set train.lock_text: true, or train.lock_text_unlocked_layers back to 0",
        ),
        (
            ["train.lock_image=true", "train.lock_image_freeze_bn_stats=true"],
            "train.lock_image_freeze_bn_stats: the ViT image tower of clipforge-tiny has no "
            "BatchNorm to freeze; set it to false",
        ),
        (
            ["train.lock_text=true", "train.lock_text_freeze_layer_norm=false"],
            "train.lock_text_freeze_layer_norm: open_clip locks the LayerNorms of its own text "
            "tower (clipforge-tiny's) with the rest; set it to true, or train a Hugging Face "
            "tower (model.text_tower)",
        ),
        (
            ["model.name=RN50", "train.lock_image=true", "train.lock_image_unlocked_groups=1"],
            "train.lock_image_unlocked_groups: open_clip locks the ResNet image tower of RN50 "
            "only whole; set it to 0, or choose a ViT model",
        ),
        (
            ["train.lock_image=true"],
            "train.lock_image: would lock the image tower of clipforge-tiny at its random "
            "initialisation (model.pretrained is not set); set model.pretrained to trained weights",
        ),
    ],
    ids=[
        "negative",
        "detail-without-lock",
        "bn-stats-of-a-vit",
        "text-layer-norm",
        "resnet",
        "random-weights",
    ],
)
def test_a_lock_open_clip_cannot_apply_is_one_line_with_the_params(sets, said):
    """Refused where the params are read (every stage that reads model and train, `fab train`
    before it ships anything), from the model's config file: no model is built."""
    with pytest.raises(ConfigError) as refused:
        load_pipeline_params(None, sets)
    assert str(refused.value) == said


def test_the_train_stage_refuses_a_bad_lock_in_one_line_before_any_work(tmp_path, capsys):
    params = write_params(tmp_path / "params.yaml", {"train": {"lock_image_freeze_bn_stats": True}})
    argv = ["--params", str(params), "--data", str(tmp_path / "data")]
    assert train_main([*argv, "--checkpoints", str(tmp_path / "checkpoints")]) == 2
    assert capsys.readouterr().err == (
        "clipforge.train: error: train.lock_image_freeze_bn_stats: true does nothing while "
        "train.lock_image is false; set train.lock_image: true, or "
        "train.lock_image_freeze_bn_stats back to false\n"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_unlocked_groups_that_leave_the_whole_tower_to_train_are_refused():
    """clipforge-tiny's ViT has 5 groups (the stem, two blocks, the last block with ln_post, the
    projection): open_clip, asked to leave 5 or more to train, locks nothing, silently."""
    model = build_model(ModelConfig()).model
    train = TrainConfig(lock_image=True, lock_image_unlocked_groups=5)
    with pytest.raises(ConfigError, match=r"^train.lock_image_unlocked_groups: 5 leaves the whole"):
        lock_towers(model, train)
