"""Distillation (train.distill_model, open_clip's DistillClipLoss): the teacher's knobs, its inputs
checked against the student's, the big batch's gradient under accumulation, and a real run
scored against its teacher by eval.

The ZeRO grid with a teacher (one and two ranks, ZeRO-1 and 3) is in test_accumulation.py
(tier2); a distillation run killed with SIGKILL and resumed, in test_resume.py."""

from __future__ import annotations

import json
import shutil

import pytest

from clipforge.fields import ConfigError
from clipforge.pipeline.params import load_pipeline_params
from tests.support.gradient_worker import TEACHER
from tests.support.workers import json_from

FP32_RTOL = 1e-5  # as test_accumulation.py: largest |accumulated - big batch| / max |big batch|


@pytest.mark.slow
def test_a_distilled_step_accumulated_over_four_micro_batches_has_the_big_batch_gradient(
    tmp_path,
):
    """One rank, ZeRO-1, k = 1 and 4, a teacher of another architecture: every gradient, the
    temperature's included, is that of one forward/backward of the whole batch with the
    teacher's logits of the whole batch, to fp32 precision."""
    out = tmp_path / "result.json"
    args = ["--stages", "1", "--accum", "1", "4", "--rtol", str(FP32_RTOL), "--loss", "distill"]
    outcome = json_from(["-m", "tests.support.gradient_worker", str(out), *args], out)
    for k in (1, 4):
        case = outcome[f"zero1-k{k}"]
        assert case["num_params"] > 50
        assert case["mismatched"] == [], (k, case)
        assert case["logit_scale_error"] < FP32_RTOL, (k, case)


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (
            ["train.distill_weight=2"],
            "train.distill_weight: set only together with train.distill_model (the teacher); "
            "set train.distill_model, or remove train.distill_weight",
        ),
        (
            ["train.distill_model=ViT-B-16"],
            "train.distill_pretrained: required with train.distill_model 'ViT-B-16', an open_clip "
            "architecture whose weights would otherwise be random (a tag such as openai, or a "
            "weights file)",
        ),
        (
            ["train.distill_model=local-dir:/teacher", "train.distill_weight=0"],
            "train.distill_weight: got 0.0; must be > 0.0",
        ),
        (
            ["train.distill_model=local-dir:/teacher", "train.loss=siglip"],
            "train.distill_model: open_clip's DistillClipLoss distils softmax logits, not "
            "train.loss: siglip's sigmoid ones; set train.loss: clip, or remove "
            "train.distill_model",
        ),
    ],
    ids=["weight-without-teacher", "architecture-without-weights", "zero-weight", "siglip"],
)
def test_a_teacher_without_weights_or_a_detail_without_a_teacher_is_refused(sets, said):
    with pytest.raises(ConfigError) as refused:
        load_pipeline_params(None, sets)
    assert str(refused.value) == said


def test_the_teacher_knobs_at_their_defaults_leave_the_run_id_alone():
    """A run of an earlier clipforge (no distillation knobs) keeps its id, so it still resumes."""
    from clipforge.train.config import run_identity

    plain = load_pipeline_params(None, []).to_dict()
    assert "distill_model" in plain["train"]
    assert not any(k.startswith("distill") for k in run_identity(plain)["train"])
    teacher = load_pipeline_params(None, ["train.distill_model=local-dir:/t"]).to_dict()
    assert run_identity(teacher)["train"] == {"distill_model": "local-dir:/t"}


def test_another_teacher_at_the_same_path_is_another_run(tmp_path, untrained_model_dir):
    """A teacher's path names no content: the run id holds the teacher's weights, so a teacher
    remade in place starts a new run rather than resuming checkpoints that learnt from the old
    one, and the same teacher names the same run."""
    from clipforge.train.config import run_id
    from clipforge.train.run import weights_sha256

    teacher = tmp_path / "teacher"
    shutil.copytree(untrained_model_dir, teacher)
    config = load_pipeline_params(None, [f"train.distill_model=local-dir:{teacher}"])
    first = run_id(config, b"manifest", weights_sha256=weights_sha256(config))
    assert run_id(config, b"manifest", weights_sha256=weights_sha256(config)) == first
    weights = teacher / "open_clip_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"!")  # other weights, the same path
    assert run_id(config, b"manifest", weights_sha256=weights_sha256(config)) != first


def test_a_teacher_that_preprocesses_or_tokenises_otherwise_is_refused_naming_both():
    """The teacher sees the student's pixels and token ids: a teacher at another image size, or
    with another tokenizer, is one line naming both; the same pipeline passes."""
    from clipforge.model.config import ModelConfig
    from clipforge.model.factory import build_model
    from clipforge.train.teacher import check_same_inputs

    student = build_model(ModelConfig(name="clipforge-tiny", image_size=32))
    same = build_model(ModelConfig(name=TEACHER, image_size=32))
    larger = build_model(ModelConfig(name=TEACHER, image_size=48))
    inputs = {
        name: (bundle.preprocess_val, bundle.tokenizer)
        for name, bundle in (("student", student), ("same", same), ("larger", larger))
    }
    check_same_inputs(inputs["same"], inputs["student"], "local-dir:t", "clipforge-tiny")
    with pytest.raises(ConfigError) as refused:
        check_same_inputs(inputs["larger"], inputs["student"], "local-dir:t", "clipforge-tiny")
    assert str(refused.value) == (
        "train.distill_model: the teacher local-dir:t cannot take the inputs of the student "
        "clipforge-tiny: its images are 48x48 px, the student's 32x32 px; choose a teacher and "
        "a student (model.name, model.image_size, model.text_tower) that preprocess and "
        "tokenise alike"
    )
    other_tokens = (inputs["same"][0], lambda texts: inputs["same"][1](texts)[:, :52])
    with pytest.raises(ConfigError, match="its tokenizer's context is 52 tokens, the student's 72"):
        check_same_inputs(other_tokens, inputs["student"], "local-dir:t", "clipforge-tiny")


@pytest.mark.slow
def test_a_smaller_student_distilled_from_a_local_dir_teacher_is_scored_against_it(
    workdir, reference_run
):
    """The issue's end to end, small: the demo's architecture trained and exported (the
    reference run) is the teacher, `local-dir:` as eval loads it; a student of another, smaller
    architecture (clipforge-micro: narrower, larger patches) trains from it on the built-in
    data and is exported; eval scores it on every suite with the teacher as its baseline."""
    from clipforge.eval.stage import main as eval_main
    from tests.conftest import run_train, write_params

    teacher = f"local-dir:{reference_run / 'models' / 'clip'}"
    sets = (
        "model.name=clipforge-micro",
        f"train.distill_model={teacher}",
        "train.distill_weight=0.5",
        "train.max_steps=4",
    )
    assert run_train(workdir, workdir / "data", *sets) == 0
    student = workdir / "models" / "clip"
    exported = json.loads((student / "open_clip_config.json").read_text())["model_cfg"]
    assert (exported["embed_dim"], exported["vision_cfg"]["patch_size"]) == (64, 16)
    assert json.loads((workdir / "metrics" / "train.info.json").read_text())["steps"] == 4

    write_params(workdir / "params.yaml", {"eval": {"baseline_model": teacher}})
    assert eval_main(["--params", "params.yaml", "--model", f"local-dir:{student}"]) == 0
    metrics = json.loads((workdir / "metrics" / "eval.json").read_text())
    suites = [name for name in metrics if name not in ("baseline", "delta", "mean_over_suites")]
    assert suites and all(name in metrics["baseline"] for name in suites)
    assert metrics["delta"]["mean_over_suites"] == pytest.approx(
        metrics["mean_over_suites"] - metrics["baseline"]["mean_over_suites"]
    )
