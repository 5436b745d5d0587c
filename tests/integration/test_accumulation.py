"""Feature-cached accumulation gives the full-batch contrastive loss and gradient, on DeepSpeed.

Each comparison runs in a fresh interpreter: a ZeRO-3 engine patches torch.nn.functional.linear
for the whole process, which would change the numerics of every later in-process run.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from clipforge.config import ModelConfig
from clipforge.model import build_model
from clipforge.train.loss import make_clip_loss
from tests.conftest import REPO, subprocess_env

pytestmark = pytest.mark.slow

GLOBAL = 32

# One optimizer step with micro batch 32 (no accumulation) and with 4 x 8 (cached accumulation),
# from the same initial weights and data; prints both losses and the weights that differ.
COMPARE = r"""
import json, sys
import deepspeed, torch
from clipforge.config import BatchPlan, ModelConfig, load_config
from clipforge.model import build_model
from clipforge.train.dist import init_distributed
from clipforge.train.ds_config import deepspeed_config
from clipforge.train.engine import create_engine
from clipforge.train.loss import contrastive_step, make_clip_loss
from clipforge.train.optim import WarmupCosine

zero_stage, GLOBAL = int(sys.argv[1]), 32
init_distributed("cpu")
generator = torch.Generator().manual_seed(0)
images = torch.randn(GLOBAL, 3, 32, 32, generator=generator)
texts = torch.randint(1, 49000, (GLOBAL, 72), generator=generator)

def one_step(micro):
    config = load_config(None, [f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={micro}",
                                f"train.zero_stage={zero_stage}"])
    torch.manual_seed(0)
    model = build_model(ModelConfig(image_size=32)).model
    plan = BatchPlan(GLOBAL, micro, GLOBAL // micro, 1)
    engine = create_engine(model, deepspeed_config(config.train, plan, "cpu", "fp32"),
                           WarmupCosine(0, 10, 0.0), 0.2)
    batches = list(zip(images.split(micro), texts.split(micro)))
    out = contrastive_step(engine, make_clip_loss(0, 1), batches, 100.0)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):  # full weights under ZeRO-3; no-op below
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out.loss, weights

big_loss, big = one_step(GLOBAL)
cached_loss, cached = one_step(8)
assert all(w.numel() for w in big.values())
mismatched = [n for n, w in big.items() if not torch.allclose(cached[n], w, rtol=1e-4, atol=1e-6)]

# The temperature cap: a logit_scale far above log(100) is used as 100 (and gets no gradient).
config = load_config(None, [f"train.global_batch_size={GLOBAL}", f"train.zero_stage={zero_stage}",
                            f"train.micro_batch_size={GLOBAL}"])
torch.manual_seed(0)
model = build_model(ModelConfig(image_size=32)).model
with torch.no_grad():
    model.logit_scale.fill_(7.0)  # exp(7) = 1097
engine = create_engine(model, deepspeed_config(config.train, BatchPlan(GLOBAL, GLOBAL, 1, 1), "cpu",
                                               "fp32"), WarmupCosine(0, 10, 0.0), 0.2)
capped = contrastive_step(engine, make_clip_loss(0, 1), [(images, texts)], 100.0).logit_scale
# ... and the export caps the stored value, so plain open_clip uses the same temperature
import tempfile
from clipforge.train.engine import fp32_state_dict
with tempfile.TemporaryDirectory() as directory:
    engine.save_checkpoint(directory, tag="capped")
    exported = fp32_state_dict(directory, "capped", 100.0)["logit_scale"]
print(json.dumps({"big_loss": big_loss, "cached_loss": cached_loss, "mismatched": mismatched,
                  "capped_logit_scale": capped, "exported_logit_scale": exported.item(),
                  "exported_shape": list(exported.shape)}))
"""


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_cached_accumulation_matches_one_big_batch(zero_stage):
    """4 micro-batches of 8 with feature caching == one batch of 32: same loss, same update;
    and the temperature is capped at 100 (ZeRO-3 included, where an in-place clamp is a no-op)."""
    result = subprocess.run(
        [sys.executable, "-c", COMPARE, str(zero_stage)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["cached_loss"] == pytest.approx(outcome["big_loss"], rel=1e-5)
    assert outcome["mismatched"] == []  # every weight within rtol 1e-4, atol 1e-6 after the step
    assert outcome["capped_logit_scale"] == 100.0  # the cap holds under every ZeRO stage
    assert outcome["exported_logit_scale"] == pytest.approx(math.log(100))
    assert outcome["exported_shape"] == []  # open_clip's 0-dim form


def test_plain_accumulation_would_change_the_objective():
    """Why caching matters: the mean of per-micro-batch losses is not the full-batch loss."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(image_size=32)).model.eval()
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(GLOBAL, 3, 32, 32, generator=generator)
    texts = torch.randint(1, 49000, (GLOBAL, 72), generator=generator)
    loss_fn = make_clip_loss(0, 1)
    with torch.no_grad():
        out = model(images, texts)
        full = loss_fn(out["image_features"], out["text_features"], out["logit_scale"]).item()
        plain = (
            sum(
                loss_fn(i, t, out["logit_scale"]).item()
                for i, t in zip(out["image_features"].split(8), out["text_features"].split(8))
            )
            / 4
        )
    assert plain < full - 0.1  # fewer negatives per image: an easier, different objective
