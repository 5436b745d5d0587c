"""Alerts on real training runs, delivered to a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import math
import socket
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import run_train
from tests.support.webhooks import SECRET, WebhookServer

pytestmark = pytest.mark.slow

# Delivery scaled down so retries and the final flush take a second, not minutes.
FAST = [
    "alerts.retry_backoff_seconds=0.05",
    "alerts.http_timeout_seconds=1",
    "alerts.flush_timeout_seconds=2",
]


@pytest.fixture
def server():
    server = WebhookServer()
    server.start()
    yield server
    server.stop()


def _rules(server: WebhookServer) -> list[str]:
    return [r.body["rule"] for r in server.received]


def test_absurd_learning_rate_raises_real_non_finite_alerts_then_stops(
    tmp_path, small_data, server, monkeypatch, capsys
):
    """lr=100 overflows the gradients (not injected): non_finite alerts arrive as generic JSON
    with the documented fields, then the run stops with a clear error and a non-zero exit."""
    monkeypatch.setenv("CLIPFORGE_ALERT_WEBHOOKS", server.url())
    code = run_train(tmp_path, small_data, "train.lr=100", "train.warmup_steps=1", *FAST)
    assert code == 2
    assert "training diverged" in capsys.readouterr().err
    rules = _rules(server)
    assert "non_finite" in rules and "non_finite_stop" in rules and rules[-1] == "run_failed"
    alert = next(r.body for r in server.received if r.body["rule"] == "non_finite")
    assert {"rule", "severity", "message", "run_id", "step", "time"} <= set(alert)
    assert alert["run_id"].startswith("run-") and isinstance(alert["step"], int)
    assert alert["severity"] == "warning" and "gradient norm is inf" in alert["message"]


# A real run (~40 s): in make test-tier2. make test keeps the skip, count, alert and rate limit on
# the alert engine itself (tests/alerts/test_monitor.py) and a real run's non_finite alerts
# (the absurd learning rate, above).
@pytest.mark.tier2
def test_nan_batches_are_skipped_counted_alerted_rate_limited_and_training_recovers(
    tmp_path, small_data, server, monkeypatch, caplog
):
    """Two poisoned batches: both steps skipped and counted; the second alert is held back by the
    rate limit (2 messages per window: GPU monitor notice + first non_finite); training ends."""
    monkeypatch.setenv("CLIPFORGE_ALERT_WEBHOOKS", server.url())
    monkeypatch.setenv("CLIPFORGE_FAULTS", "nan@3,nan@4")
    caplog.set_level(logging.INFO, logger="clipforge")
    assert run_train(tmp_path, small_data, "alerts.max_messages_per_window=2", *FAST) == 0
    (non_finite,) = [r.body for r in server.received if r.body["rule"] == "non_finite"]
    assert non_finite["step"] == 3 and non_finite["details"]["total"] == 1
    assert "loss is nan at step 4 (2 in a row, 2 in this run" in caplog.text
    assert "held back" in caplog.text
    assert json.loads((tmp_path / "metrics" / "train.info.json").read_text())["steps"] == 12
    assert math.isfinite(json.loads((tmp_path / "metrics" / "train.json").read_text())["loss"])
    assert _rules(server)[-1] == "run_finished"


# A real run (~35 s): in make test-tier2. make test keeps the stall alert and its recovery on the
# alert engine (tests/alerts/test_monitor.py) and the progress heartbeat
# (tests/test_progress.py).
@pytest.mark.tier2
def test_a_blocked_step_produces_a_stall_alert(tmp_path, small_data, server, monkeypatch):
    monkeypatch.setenv("CLIPFORGE_ALERT_WEBHOOKS", server.url())
    monkeypatch.setenv("CLIPFORGE_FAULTS", "stall@3=4")
    assert (
        run_train(
            tmp_path,
            small_data,
            "alerts.stall_timeout_seconds=1.5",
            "alerts.min_seconds_between_repeats=0",
            *FAST,
        )
        == 0
    )
    stalls = [r.body for r in server.received if r.body["rule"] == "stall"]
    # step 2 is the last one completed before the blocked step 3 (a slow machine may add others)
    assert any(s["step"] == 2 and s["severity"] == "critical" for s in stalls), stalls
    assert "stall_recovered" in _rules(server)


def test_dead_slow_and_failing_webhooks_change_nothing_and_leak_no_secret(
    tmp_path, small_data, reference_run, monkeypatch, caplog
):
    """Three broken targets at once: refused connections, a server slower than a step, HTTP 500.
    Training ends with the exact weights of the reference run (no alerts configured); retries
    show in the log; the secret URL appears nowhere in the run's outputs or log."""
    slow, failing = WebhookServer(), WebhookServer()
    slow.hold_seconds = 5.0
    failing.statuses.extend([500] * 100)
    for s in (slow, failing):
        s.start()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/hook/{SECRET}"
    monkeypatch.setenv(
        "CLIPFORGE_ALERT_WEBHOOKS", ",".join([dead, slow.url("slack"), failing.url("feishu")])
    )
    caplog.set_level(logging.INFO, logger="clipforge")
    try:
        assert run_train(tmp_path, small_data, *FAST) == 0
    finally:
        slow.stop()
        failing.stop()

    expected = load_file(str(reference_run / "models/clip/open_clip_model.safetensors"))
    got = load_file(str(tmp_path / "models/clip/open_clip_model.safetensors"))
    assert got.keys() == expected.keys()
    assert all((got[k] == expected[k]).all() for k in expected)
    log = caplog.text
    assert "HTTP 500" in log and "attempt" in log  # retries of the failing target
    assert SECRET not in log
    for path in Path(tmp_path).rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"secret leaked into {path}"
