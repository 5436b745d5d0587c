"""Cached accumulation with dropout: the forward with gradients of a micro-batch draws the same
random numbers as its cached forward, so the fresh features replace cached ones that are equal
(otherwise the summed gradient is not the big batch's)."""

from __future__ import annotations

import pytest
import torch

from clipforge.pipeline.params import load_pipeline_params
from clipforge.train.config import BatchPlan
from clipforge.train.dist import init_distributed
from clipforge.train.ds_config import deepspeed_config
from clipforge.train.engine import create_engine
from clipforge.train.loss import accumulate_gradients, make_loss
from clipforge.train.optim import WarmupCosine

pytestmark = pytest.mark.slow


class DropoutClip(torch.nn.Module):
    """Two linear towers with dropout (as Hugging Face text towers have), open_clip's outputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(12, 8)
        self.text = torch.nn.Embedding(100, 8)
        self.dropout = torch.nn.Dropout(0.5)
        self.logit_scale = torch.nn.Parameter(torch.ones([]) * 2.0)
        self.seen: list[torch.Tensor] = []

    def forward(self, image, text):
        features = torch.nn.functional.normalize(self.dropout(self.image(image)), dim=-1)
        self.seen.append(features.detach().clone())
        return {
            "image_features": features,
            "text_features": torch.nn.functional.normalize(self.text(text).mean(1), dim=-1),
            "logit_scale": self.logit_scale.exp(),
        }


def test_the_recomputed_forward_of_each_micro_batch_equals_its_cached_one():
    init_distributed("cpu")
    train = load_pipeline_params(
        None, ["train.global_batch_size=8", "train.micro_batch_size=4"]
    ).train
    plan = BatchPlan(8, 4, 2, 1)
    model = DropoutClip()
    engine = create_engine(
        model, deepspeed_config(train, plan, "cpu", "fp32"), WarmupCosine(0, 10, 0.0), 0.2
    )
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4, 12, generator=generator), torch.randint(0, 100, (4, 5))) for _ in range(2)
    ]
    accumulate_gradients(engine, make_loss("clip", 0, 1), batches)
    cached_0, cached_1, fresh_0, fresh_1 = model.seen
    assert (cached_0 == 0).any()  # dropout is on: some features were dropped
    assert torch.equal(fresh_0, cached_0) and torch.equal(fresh_1, cached_1)
