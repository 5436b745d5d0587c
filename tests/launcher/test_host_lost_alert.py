"""The recovery controller's `host_lost` alert reaches the webhooks (a real receiver on
127.0.0.1), naming the lost host, the launch and the training run, and docs/alerts.md says what
it means. In-process against a real sshd, seconds: the host misses its probes (no supervisor
state), the move to a spare where nothing listens fails, and that is a critical `host_lost`."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

from clipforge.alerts import events
from tests.conftest import REPO
from tests.launcher.test_controller import LAUNCH_ID, _controller
from tests.support.sshd import free_port

TRAINING_RUN = "run-0123456789ab"


def test_a_lost_host_is_alerted_to_the_webhook_with_host_launch_and_run(
    tmp_path, sshd, webhook, monkeypatch
):
    monkeypatch.setenv("CLIPFORGE_ALERT_WEBHOOKS", webhook.url())
    spare = f"{sshd.user}@127.0.0.1:{free_port()}"
    controller, _ = _controller(tmp_path, sshd, spares=[spare])
    # the run store's record of the launch, as the train stage writes it: it names the run
    launches = tmp_path / "store" / "launches"
    launches.mkdir(parents=True)
    (launches / f"{LAUNCH_ID}.json").write_text(json.dumps({"training_run": TRAINING_RUN}))
    assert controller.run() == 1

    (alert,) = [r.body for r in webhook.received if r.body["rule"] == events.HOST_LOST]
    assert alert["severity"] == "critical"  # the move failed; a move that worked is a warning
    assert alert["launch_id"] == LAUNCH_ID and alert["run_id"] == TRAINING_RUN
    assert alert["host"] == socket.gethostname()  # the controller's, which sent it
    assert f"{sshd.address} gone: " in alert["message"]  # the lost one
    assert f"the move to {spare} failed" in alert["message"]
    rules = [r.body["rule"] for r in webhook.received]
    assert rules == [events.HOST_LOST, events.RUN_FAILED]  # no spare left after that


def test_host_lost_is_documented_in_the_alerts_table():
    text = (REPO / "docs" / "alerts.md").read_text(encoding="utf-8")
    (row,) = re.findall(rf"^\| `{events.HOST_LOST}` \|.*$", text, flags=re.MULTILINE)
    assert "recovery controller" in row and "critical when that move failed" in row
    assert Path(REPO / "docs" / "launcher.md").read_text().count("host_lost") >= 1
