"""model.patch_dropout: FLIP-style patch dropout in training, every patch at evaluation."""

from __future__ import annotations

import torch

from clipforge.model.config import ModelConfig
from clipforge.model.factory import build_model


def _tokens_seen(model: torch.nn.Module, images: torch.Tensor) -> int:
    """Tokens the image tower's first block receives."""
    seen = []
    hook = model.visual.transformer.resblocks[0].register_forward_pre_hook(
        lambda module, args: seen.append(args[0].shape[1])
    )
    with torch.no_grad():
        model.encode_image(images)
    hook.remove()
    return seen[0]


def test_training_drops_that_share_of_patches_and_evaluation_sees_them_all():
    bundle = build_model(ModelConfig(patch_dropout=0.5))
    dropped, side = bundle.model, bundle.model_cfg["vision_cfg"]["image_size"]
    full = build_model(ModelConfig()).model
    full.load_state_dict(dropped.state_dict())
    images = torch.randn(2, 3, side, side)
    patches = _tokens_seen(full.train(), images) - 1  # the class token is always kept
    assert _tokens_seen(dropped.train(), images) - 1 == patches // 2
    assert _tokens_seen(dropped.eval(), images) - 1 == patches
    with torch.no_grad():
        torch.testing.assert_close(
            dropped.eval().encode_image(images), full.eval().encode_image(images)
        )


def test_the_export_config_has_no_patch_dropout():
    """The exported architecture is the plain one: plain open_clip builds it unchanged."""
    bundle = build_model(ModelConfig(patch_dropout=0.5))
    assert "patch_dropout" not in bundle.model_cfg["vision_cfg"]
