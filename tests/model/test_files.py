"""A model folder or weights file that cannot give the whole model is an error naming the file, in
every stage that loads weights: eval's --model and eval.baseline_model, the train stage's
model.pretrained and train.distill_model. Before, a local-dir folder without its weights file was evaluated as a randomly
initialised model, with exit 0 and a metrics file."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from clipforge.eval.stage import main as eval_main
from tests.conftest import eval_argv, run_train, write_params

WEIGHTS = "open_clip_model.safetensors"


@pytest.fixture
def model_dir(tmp_path, untrained_model_dir):
    return shutil.copytree(untrained_model_dir, tmp_path / "clip")


def _eval(tmp_path, small_data, model: str, params_overrides: dict | None = None) -> int:
    params = write_params(tmp_path / "params.yaml", params_overrides)
    out = tmp_path / "metrics" / "eval.json"
    return eval_main(eval_argv(params, model, small_data / "test", out))


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


def _truncate(path, keep: int = 1000) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _drop_one_tensor(path) -> str:
    weights = load_file(str(path))
    dropped = sorted(weights)[0]
    del weights[dropped]
    save_file(weights, str(path))
    return dropped


def test_eval_refuses_a_model_folder_without_weights(tmp_path, small_data, model_dir, capsys):
    (model_dir / WEIGHTS).unlink()
    assert _eval(tmp_path, small_data, f"local-dir:{model_dir}") == 2
    assert capsys.readouterr().err == (
        f"clipforge.eval: error: --model: no weights in {model_dir}: expected {WEIGHTS} (or "
        f"open_clip_pytorch_model.bin); without them the model would be randomly initialised\n"
    )
    assert not (tmp_path / "metrics").exists()


def test_eval_refuses_a_model_folder_without_its_config(tmp_path, small_data, model_dir, capsys):
    (model_dir / "open_clip_config.json").unlink()
    assert _eval(tmp_path, small_data, f"local-dir:{model_dir}") == 2
    assert capsys.readouterr().err == (
        f"clipforge.eval: error: --model: {model_dir}/open_clip_config.json not found: a local-dir "
        f"model needs the architecture beside its weights (copy the whole exported folder)\n"
    )
    assert not (tmp_path / "metrics").exists()


def test_eval_refuses_a_truncated_weights_file(tmp_path, small_data, model_dir, capsys):
    _truncate(model_dir / WEIGHTS)
    assert _eval(tmp_path, small_data, f"local-dir:{model_dir}") == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"clipforge.eval: error: --model: {model_dir / WEIGHTS} cannot be loaded: "
    )
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "metrics").exists()


def test_eval_refuses_weights_that_leave_a_parameter_out(tmp_path, small_data, model_dir, capsys):
    dropped = _drop_one_tensor(model_dir / WEIGHTS)
    assert _eval(tmp_path, small_data, f"local-dir:{model_dir}") == 2
    assert capsys.readouterr().err == (
        f"clipforge.eval: error: --model: {model_dir / WEIGHTS} does not fit the model (1 "
        f"parameters missing, e.g. {dropped}, 0 unexpected): a partial file, or weights of "
        f"another architecture\n"
    )
    assert not (tmp_path / "metrics").exists()


def test_an_architecture_name_alone_is_refused_as_model_and_as_baseline(
    tmp_path, small_data, untrained_model_dir, capsys
):
    assert _eval(tmp_path, small_data, "clipforge-tiny") == 2
    assert capsys.readouterr().err == (
        "clipforge.eval: error: --model clipforge-tiny: an open_clip architecture, whose weights "
        "would be random: name them with --pretrained TAG or FILE (open_clip has no tags for "
        "clipforge-tiny)\n"
    )
    model = f"local-dir:{untrained_model_dir}"
    assert _eval(tmp_path, small_data, model, {"eval": {"baseline_model": "clipforge-tiny"}}) == 2
    assert capsys.readouterr().err.startswith(
        "clipforge.eval: error: eval.baseline_pretrained: required with eval.baseline_model "
        "'clipforge-tiny', an open_clip architecture whose weights would otherwise be random"
    )
    assert not (tmp_path / "metrics").exists()


def test_a_baseline_without_weights_is_refused_before_the_model_is_evaluated(
    tmp_path, small_data, untrained_model_dir, model_dir, capsys
):
    (model_dir / WEIGHTS).unlink()
    baseline = {"eval": {"baseline_model": f"local-dir:{model_dir}"}}
    assert _eval(tmp_path, small_data, f"local-dir:{untrained_model_dir}", baseline) == 2
    assert capsys.readouterr().err.startswith(
        f"clipforge.eval: error: eval.baseline_model: no weights in {model_dir}: "
    )
    assert not (tmp_path / "metrics").exists()


def test_a_baseline_weights_file_is_loaded_whole(tmp_path, small_data, untrained_model_dir, capsys):
    """An open_clip name with a weights file as eval.baseline_pretrained: the same checks."""
    weights = tmp_path / "baseline.safetensors"
    shutil.copyfile(untrained_model_dir / WEIGHTS, weights)
    dropped = _drop_one_tensor(weights)
    baseline = {
        "eval": {"baseline_model": "clipforge-tiny", "baseline_pretrained": str(weights)},
        "model": {"image_size": 32},
    }
    assert _eval(tmp_path, small_data, f"local-dir:{untrained_model_dir}", baseline) == 2
    assert f"1 parameters missing, e.g. {dropped}" in capsys.readouterr().err
    assert not (tmp_path / "metrics").exists()


def test_train_refuses_initial_weights_that_are_missing_or_damaged(
    tmp_path, small_data, model_dir, capsys
):
    """model.pretrained: a folder without weights fails before the model is built; a truncated
    file once it is read. Neither writes a checkpoint."""
    _truncate(model_dir / WEIGHTS)
    assert run_train(tmp_path, small_data, f"model.pretrained=local-dir:{model_dir}") == 2
    (error,) = _error_lines(capsys.readouterr().err)  # besides library warnings (CUDA) before
    assert error.startswith(
        f"clipforge.train: error: model.pretrained: {model_dir / WEIGHTS} cannot be loaded: "
    )
    (model_dir / WEIGHTS).unlink()
    assert run_train(tmp_path, small_data, f"model.pretrained=local-dir:{model_dir}") == 2
    assert capsys.readouterr().err.startswith(
        f"clipforge.train: error: model.pretrained: no weights in {model_dir}: "
    )
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "models").exists()


def test_train_refuses_a_teacher_without_weights_before_anything_is_built(
    tmp_path, small_data, model_dir, capsys
):
    """train.distill_model is checked as eval checks its models: a folder without weights is one
    line before the training stack loads, and no checkpoint is written."""
    (model_dir / WEIGHTS).unlink()
    sets = ("model.name=clipforge-micro", f"train.distill_model=local-dir:{model_dir}")
    assert run_train(tmp_path, small_data, *sets) == 2
    assert capsys.readouterr().err == (
        f"clipforge.train: error: train.distill_model: no weights in {model_dir}: expected "
        f"{WEIGHTS} (or open_clip_pytorch_model.bin); without them the model would be randomly "
        f"initialised\n"
    )
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "models").exists()
