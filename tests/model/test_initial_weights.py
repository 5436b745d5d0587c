"""Models by name and initial weights from files, loaded without executing code."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from clipforge.model.config import ModelConfig
from clipforge.model.factory import build_model

pytestmark = pytest.mark.slow


def test_init_from_an_exported_local_dir_gives_its_weights(reference_run):
    model_dir = reference_run / "models" / "clip"
    model = build_model(ModelConfig(image_size=32, pretrained=f"local-dir:{model_dir}")).model
    exported = load_file(str(model_dir / "open_clip_model.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[k], exported[k]) for k in exported)


def test_init_from_a_safetensors_file(reference_run, tmp_path):
    exported = load_file(str(reference_run / "models" / "clip" / "open_clip_model.safetensors"))
    path = tmp_path / "weights.safetensors"
    save_file(exported, str(path))
    model = build_model(ModelConfig(image_size=32, pretrained=str(path))).model
    assert torch.equal(model.state_dict()["logit_scale"], exported["logit_scale"])


class _Payload:
    """A pickle that runs code when loaded: what a malicious checkpoint looks like."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {"x": _Payload(marker)}}, str(path))
    with pytest.raises(Exception, match="(?i)weights only|unpickl|unsupported"):
        build_model(ModelConfig(image_size=32, pretrained=str(path)))
    assert not marker.exists()


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="model.name: unknown model 'ViT-Z-99'"):
        build_model(ModelConfig(name="ViT-Z-99"))
