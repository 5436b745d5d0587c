"""The supervisor's own alerts: a run given up on, or found hung.

When it gives up on a run (the stage, which sends every other alert, is not running then), and when
its watchdog finds the run hung. Same webhooks (CLIPFORGE_ALERT_WEBHOOKS, in the supervisor's
environment only), same delivery and formats as the stage's (clipforge.alerts, standard library).
"""

from __future__ import annotations

import logging
import os
import socket
import time

from clipforge.alerts import events
from clipforge.alerts.config import AlertsConfig
from clipforge.alerts.delivery import WebhookDispatcher
from clipforge.alerts.events import Alert
from clipforge.alerts.targets import load_targets, redact


def send_run_failed(message: str, launch_id: str, run_id: str | None) -> str:
    """Deliver a `run_failed` alert to every configured webhook; one line saying how it went.
    `run_id`: the training run's, when its checkpoints tell it (None before it saved any)."""
    return send_alert(events.RUN_FAILED, "critical", message, launch_id, run_id)


def send_alert(rule: str, severity: str, message: str, launch_id: str, run_id: str | None) -> str:
    """Deliver one alert to every configured webhook; one line saying how it went."""
    try:
        targets = load_targets(os.environ)
    except ValueError as exc:
        return f"alert not sent: {exc}"
    if not targets:
        return "alert not sent: no webhooks configured (CLIPFORGE_ALERT_WEBHOOKS)"
    config = AlertsConfig()
    outcomes: list = []
    dispatcher = WebhookDispatcher(
        targets, config, log=logging.getLogger(__name__), on_outcome=outcomes.append
    )
    dispatcher.start()
    dispatcher.submit(
        Alert(
            rule=rule,
            severity=severity,
            message=redact(message, targets),
            run_id=run_id,
            launch_id=launch_id,
            step=None,
            time=time.time(),
            host=socket.gethostname(),
        )
    )
    dispatcher.close(config.flush_timeout_seconds)
    return "; ".join(o.summary() for o in outcomes) or "alert: delivery timed out"
