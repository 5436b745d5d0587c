"""Every result file names the stack, params and data that produced it (clipforge.envrecord)."""

from __future__ import annotations

import hashlib
import json
import platform
from importlib import metadata

import pytest

from clipforge.eval.stage import main as eval_main
from tests.conftest import eval_argv, write_params

pytestmark = pytest.mark.slow


def _installed() -> dict[str, str]:
    """Read here, independently of clipforge."""
    import deepspeed
    import open_clip
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "open_clip": open_clip.__version__,
        "transformers": transformers.__version__,
        "torch (metadata)": metadata.version("torch"),
    }


def _check_stack(environment: dict) -> None:
    stack = environment["stack"]
    installed = _installed()
    for name in ("python", "torch", "deepspeed", "open_clip", "transformers"):
        assert stack[name] == installed[name], name
    assert stack["torch"].startswith(installed["torch (metadata)"])
    import torch

    assert stack["cuda"] == torch.version.cuda
    assert len(stack["packages_sha256"]) == 64


def test_train_info_and_model_card_carry_the_environment(reference_run, small_data):
    info = json.loads((reference_run / "metrics" / "train.info.json").read_text())
    environment = info["environment"]
    _check_stack(environment)
    manifest_sha = hashlib.sha256((small_data / "manifest.json").read_bytes()).hexdigest()
    assert environment["data_manifest_sha256"] == manifest_sha
    assert environment["process"] == "train stage"
    # the resolved params the stage ran with, as the export keeps them
    config = (reference_run / "models" / "clip" / "clipforge_config.yaml").read_bytes()
    assert environment["params_sha256"] == hashlib.sha256(config).hexdigest()
    assert environment["plan"] == {
        "seed": 0,
        "global_batch_size": 32,
        "micro_batch_size": 16,
        "grad_accum_steps": 2,
        "world_size": 1,
    }
    card = (reference_run / "models" / "clip" / "README.md").read_text()
    assert manifest_sha in card
    for name, version in _installed().items():
        assert version in card, name
    # a run `fab train` did not start: no `fab rerun` line that could not work
    assert f"Run `{info['run_id']}` was not started by `fab train`" in card
    assert "fab rerun" not in card.replace("`fab rerun` cannot", "")
    # the manifest itself, which `fab rerun` checks the data against shard by shard
    assert info["data_manifest"] == json.loads((small_data / "manifest.json").read_text())


def test_eval_info_carries_the_environment(reference_run, small_data, tmp_path):
    out = tmp_path / "metrics" / "eval.json"
    params = write_params(tmp_path / "params.yaml")
    model = f"local-dir:{reference_run / 'models' / 'clip'}"
    assert eval_main(eval_argv(params, model, small_data / "test", out)) == 0
    environment = json.loads(out.with_suffix(".info.json").read_text())["environment"]
    _check_stack(environment)
    assert environment["process"] == "eval stage"
    manifest_sha = hashlib.sha256((small_data / "manifest.json").read_bytes()).hexdigest()
    assert environment["data_manifest_sha256"] == manifest_sha
