"""Feature-cached accumulation gives the full-batch contrastive loss and gradient, on DeepSpeed."""
from __future__ import annotations

import pytest
import torch

from clipforge.config import BatchPlan, ModelConfig, load_config
from clipforge.model import build_model
from clipforge.train.dist import init_distributed
from clipforge.train.ds_config import deepspeed_config
from clipforge.train.engine import create_engine
from clipforge.train.loss import contrastive_step, make_clip_loss
from clipforge.train.optim import WarmupCosine

pytestmark = pytest.mark.slow

GLOBAL = 32


def _batch():
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(GLOBAL, 3, 32, 32, generator=generator)
    texts = torch.randint(1, 49000, (GLOBAL, 72), generator=generator)
    return images, texts


def _engine(micro: int, zero_stage: int):
    config = load_config(None, [f"train.global_batch_size={GLOBAL}",
                                f"train.micro_batch_size={micro}", f"train.zero_stage={zero_stage}"])
    plan = BatchPlan(GLOBAL, micro, GLOBAL // micro, 1)
    torch.manual_seed(0)
    model = build_model(ModelConfig(image_size=32)).model
    ds_config = deepspeed_config(config.train, plan, "cpu", "fp32")
    return create_engine(model, ds_config, WarmupCosine(0, 10, 0.0), 0.2), plan


def _one_step(micro: int, zero_stage: int = 1):
    init_distributed("cpu")
    engine, plan = _engine(micro, zero_stage)
    images, texts = _batch()
    micro_batches = list(zip(images.split(micro), texts.split(micro)))
    out = contrastive_step(engine, make_clip_loss(0, 1), micro_batches, 100.0)
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):  # full weights under ZeRO-3; no-op below
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out.loss, weights


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_cached_accumulation_matches_one_big_batch(zero_stage):
    """4 micro-batches of 8 with feature caching == one batch of 32: same loss, same update."""
    big_loss, big_weights = _one_step(micro=GLOBAL, zero_stage=zero_stage)
    cached_loss, cached_weights = _one_step(micro=8, zero_stage=zero_stage)
    assert cached_loss == pytest.approx(big_loss, rel=1e-5)
    for name, weight in big_weights.items():
        assert weight.numel() > 0
        torch.testing.assert_close(cached_weights[name], weight, rtol=1e-4, atol=1e-6,
                                   msg=f"{name} differs after one step")


def test_plain_accumulation_would_change_the_objective():
    """Why caching matters: the mean of per-micro-batch losses is not the full-batch loss."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(image_size=32)).model.eval()
    images, texts = _batch()
    loss_fn = make_clip_loss(0, 1)
    with torch.no_grad():
        out = model(images, texts)
        full = loss_fn(out["image_features"], out["text_features"], out["logit_scale"]).item()
        plain = sum(loss_fn(i, t, out["logit_scale"]).item() for i, t in
                    zip(out["image_features"].split(8), out["text_features"].split(8))) / 4
    assert plain < full - 0.1  # fewer negatives per image: an easier, different objective
