"""`train.compile` on the CPU: DeepSpeed's engine.compile (what the train stage calls) with the
aot_eager backend, which runs TorchDynamo and AOTAutograd's forward and backward graphs, the
graphs inductor generates code from on a GPU, and executes them eagerly. The GPU's inductor
itself is first measured by the device run (bench/gpu.py's compile section, BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch

from clipforge.pipeline.params import load_pipeline_params
from clipforge.train.config import BatchPlan
from clipforge.train.dist import init_distributed
from clipforge.train.ds_config import deepspeed_config
from clipforge.train.engine import create_engine
from clipforge.train.loss import contrastive_step, make_loss
from clipforge.train.optim import WarmupCosine
from tests.support.gradient_worker import GLOBAL, _model, _rank_micro_batches

# Two compiles and runs (20 s): in make test-tier2 (.ci/run).
pytestmark = [pytest.mark.slow, pytest.mark.tier2]


def _losses(backend: str | None) -> list[float]:
    config = load_pipeline_params(
        None, [f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={GLOBAL}"]
    )
    ds_config = deepspeed_config(config.train, BatchPlan(GLOBAL, GLOBAL, 1, 1), "cpu", "fp32")
    engine = create_engine(
        _model(), ds_config, WarmupCosine(0, 10, 0.0), 0.2, backend is not None, backend
    )
    batches = _rank_micro_batches(1, 1, 0, torch.float32)
    return [
        contrastive_step(engine, make_loss("clip", 0, 1), batches).loss.item() for _ in range(2)
    ]


def test_the_compiled_model_trains_the_steps_of_the_eager_one():
    """Two steps of the tiny model through the compiled forward and backward give the eager
    losses bit for bit (the second after an optimizer step: the backward graph's gradients
    reached the update)."""
    init_distributed("cpu")
    eager = _losses(None)
    assert _losses("aot_eager") == eager
    assert eager[0] != eager[1]
