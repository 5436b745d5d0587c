"""The text tower on the causal-flag attention path computes what open_clip's float mask does."""

from __future__ import annotations

import torch

from clipforge.model.config import ModelConfig
from clipforge.model.factory import (
    CausalFlagAttention,
    build_model,
    flag_causal_text_attention,
    without_causal_flag,
)


def test_build_model_puts_every_text_attention_layer_on_the_causal_flag_path():
    model = build_model(ModelConfig()).model
    kinds = {type(block.attn) for block in model.transformer.resblocks}
    assert kinds == {CausalFlagAttention}
    assert len(model.transformer.resblocks) > 1


def test_text_features_and_gradients_equal_the_float_mask_path():
    torch.manual_seed(0)
    flagged = build_model(ModelConfig()).model.train()
    plain = without_causal_flag(flagged)
    texts = torch.randint(1, 49000, (4, flagged.context_length))
    out = flagged.encode_text(texts)
    reference = plain.encode_text(texts)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    reference.square().sum().backward()
    for (name, a), b in zip(flagged.named_parameters(), plain.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_state_dict_is_open_clips():
    flagged = build_model(ModelConfig()).model
    plain = without_causal_flag(flagged)
    assert flagged.state_dict().keys() == plain.state_dict().keys()


def test_a_text_mask_that_is_not_the_causal_one_is_left_alone():
    """Only exactly open_clip's causal mask may be replaced by the flag (a bidirectional or
    padded mask would change the result)."""
    model = without_causal_flag(build_model(ModelConfig()).model)
    model.attn_mask = torch.zeros_like(model.attn_mask)
    assert flag_causal_text_attention(model) == 0
    assert {type(b.attn) for b in model.transformer.resblocks} == {torch.nn.MultiheadAttention}


def test_evaluation_without_gradients_gives_the_same_features():
    """Under no_grad in eval mode torch may take MultiheadAttention's fast path: same result."""
    flagged = build_model(ModelConfig()).model.eval()
    plain = without_causal_flag(flagged)
    texts = torch.randint(1, 49000, (3, flagged.context_length))
    with torch.no_grad():
        torch.testing.assert_close(
            flagged.encode_text(texts), plain.encode_text(texts), rtol=1e-5, atol=1e-5
        )
