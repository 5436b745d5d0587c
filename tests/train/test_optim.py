"""AdamW groups and the warm-up + cosine schedule."""

from __future__ import annotations

import math

import pytest

from clipforge.model.config import ModelConfig
from clipforge.model.factory import build_model
from clipforge.train.engine import make_learned_scalars_1d
from clipforge.train.optim import WarmupCosine, param_groups


def test_schedule_warms_up_linearly_then_decays_to_the_floor():
    schedule = WarmupCosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert [schedule(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert schedule(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule(110) == pytest.approx(0.1)
    values = [schedule(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_no_decay_for_gains_biases_class_token_and_logit_scale():
    model = build_model(ModelConfig()).model
    make_learned_scalars_1d(model)
    decay, exempt = param_groups(model, weight_decay=0.2)
    names = {id(p): n for n, p in model.named_parameters()}
    exempt_names = {names[id(p)] for p in exempt["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert "logit_scale" in exempt_names and "visual.class_embedding" in exempt_names
    assert all(
        n.endswith(("bias", "weight")) or "embedding" in n or "proj" in n or n == "logit_scale"
        for n in exempt_names | decay_names
    )
    assert not any(n.endswith(".bias") or ".ln_" in n for n in decay_names)
    assert "visual.conv1.weight" in decay_names and "token_embedding.weight" in decay_names
    assert (decay["weight_decay"], exempt["weight_decay"]) == (0.2, 0.0)
