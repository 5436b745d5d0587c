"""The training loop feeds the health rules on a real run: values read at log intervals reach
the rules, and an alert reaches a webhook on 127.0.0.1."""

from __future__ import annotations

import pytest
import torch

from clipforge.train.health import FeatureTap, health_reading
from tests.conftest import run_train
from tests.support.webhooks import WebhookServer

pytestmark = pytest.mark.slow


# A real run (25 s): in make test-tier2. make test keeps the rules on readings
# (tests/alerts/) and the accuracy read below.
@pytest.mark.tier2
def test_a_cap_below_the_initial_temperature_pins_it_and_alerts(tmp_path, small_data, monkeypatch):
    """train.max_logit_scale=5 clamps CLIP's initial 14.3 from the first step on: the loop's
    logged logit scale sits at the cap and `temperature_pinned` arrives, once."""
    server = WebhookServer()
    server.start()
    try:
        monkeypatch.setenv("CLIPFORGE_ALERT_WEBHOOKS", server.url())
        code = run_train(
            tmp_path,
            small_data,
            "train.max_logit_scale=5",
            "alerts.health_patience_logs=2",
            "alerts.flush_timeout_seconds=2",
        )
        assert code == 0
        pinned = [r.body for r in server.received if r.body["rule"] == "temperature_pinned"]
    finally:
        server.stop()
    assert len(pinned) == 1
    assert pinned[0]["details"]["cap"] == 5.0
    assert 0.99 * 5.0 <= pinned[0]["details"]["logit_scale"] <= 5.0


def test_accuracy_is_measured_on_the_last_call_and_read_once():
    """Matching features give accuracy 1; a permutation of the captions gives 0; both values
    arrive in one reading with the number of pairs."""
    tap = FeatureTap(lambda image, text, scale: (image * text).sum())
    features = torch.eye(8)
    tap(features, features, torch.tensor(1.0))
    reading = health_reading(3, tap, torch.tensor([20.0]), 100.0)
    assert (reading.accuracy, reading.batch_size, reading.logit_scale) == (1.0, 8, 20.0)
    tap(features, features.roll(1, dims=0), torch.tensor(1.0))
    assert health_reading(4, tap, torch.tensor(20.0), 100.0).accuracy == 0.0
