"""Webhook delivery against a real HTTP server on 127.0.0.1: payloads, retries, slow and dead
receivers, the bounded queue, and the flush at shutdown."""

from __future__ import annotations

import email.utils
import logging
import re
import time

import pytest

from clipforge.alerts.delivery import WebhookDispatcher
from clipforge.alerts.events import Alert
from clipforge.alerts.targets import parse_targets
from tests.support.webhooks import SECRET, WAIT_SECONDS, eventually, fast_config

LOG = logging.getLogger("clipforge.alerts.test")


def alert(step: int = 7, rule: str = "non_finite") -> Alert:
    return Alert(
        rule=rule,
        severity="warning",
        message="loss is nan",
        run_id="run-1",
        step=step,
        time=1_700_000_000.0,
        host="node-0",
    )


class Dispatch:
    """A started dispatcher to the given entries, recording outcomes."""

    def __init__(self, entries, **config):
        self.outcomes = []
        self.dispatcher = WebhookDispatcher(
            parse_targets(entries, source="test"),
            fast_config(**config),
            log=LOG,
            on_outcome=self.outcomes.append,
        )
        self.dispatcher.start()

    def close(self, timeout=WAIT_SECONDS):  # returns once flushed: a safety limit
        self.dispatcher.close(timeout)


def test_each_kind_receives_its_payload(webhook_server):
    """Feishu, Slack and generic targets each get one JSON POST in their own format."""
    d = Dispatch([webhook_server.url("feishu"), webhook_server.url("slack"), webhook_server.url()])
    d.dispatcher.submit(alert())
    received = webhook_server.wait_for(3)
    d.close()
    assert all(r.content_type.startswith("application/json") for r in received)
    shapes = sorted(tuple(sorted(r.body)) for r in received)
    assert ("content", "msg_type") in shapes and ("blocks", "text") in shapes
    assert any(r.body.get("rule") == "non_finite" and r.body.get("step") == 7 for r in received)
    assert all(o.ok and o.attempts == 1 for o in d.outcomes)


def test_http_500_is_retried_then_given_up_and_logged(webhook_server, caplog):
    """A receiver answering 500 is tried 1 + max_retries times; each retry and the final
    failure are in the log."""
    caplog.set_level(logging.INFO, logger="clipforge.alerts")
    webhook_server.statuses.extend([500] * 10)
    d = Dispatch([webhook_server.url()], max_retries=2)
    d.dispatcher.submit(alert())
    eventually(lambda: d.outcomes, "the delivery outcome")
    d.close()
    assert len(webhook_server.received) == 3
    assert [o.ok for o in d.outcomes] == [False] and d.outcomes[0].attempts == 3
    assert "attempt 1 of 3: HTTP 500; retrying" in caplog.text
    assert "attempt 2 of 3: HTTP 500; retrying" in caplog.text
    assert "NOT delivered" in caplog.text and "after 3 attempt(s): HTTP 500" in caplog.text


def test_retry_succeeds_after_a_transient_error(webhook_server):
    """503 then 200: delivered on the second attempt."""
    webhook_server.statuses.extend([503])
    d = Dispatch([webhook_server.url()])
    d.dispatcher.submit(alert())
    eventually(lambda: d.outcomes, "the delivery outcome")
    d.close()
    assert d.outcomes[0].ok and d.outcomes[0].attempts == 2


@pytest.mark.parametrize("form", ["seconds", "HTTP date"])
def test_retry_waits_as_long_as_retry_after_says_in_either_form(webhook_server, caplog, form):
    """A 503 with Retry-After 30 s ahead (as `30` or as an HTTP date) puts the retry 30 s away,
    not at the 0.01 s back-off; closing the dispatcher then ends the wait. The date is read at
    some moment between its making and the log line: the delay is bracketed by those two."""
    caplog.set_level(logging.INFO, logger="clipforge.alerts")
    webhook_server.statuses.append(503)
    made = time.time()
    retry_at = int(made) + 30  # an HTTP date has whole seconds
    webhook_server.retry_after = (
        "30" if form == "seconds" else email.utils.formatdate(retry_at, usegmt=True)
    )
    d = Dispatch([webhook_server.url()])
    d.dispatcher.submit(alert())
    eventually(lambda: "retrying in" in caplog.text, "the first retry to be scheduled")
    logged = time.time()
    d.close(timeout=0.0)
    delay = float(re.search(r"retrying in (\S+) s", caplog.text).group(1))
    if form == "seconds":
        assert delay == 30.0
    else:  # the log shows 3 significant digits: 0.05 s of rounding either way
        assert retry_at - logged - 0.05 <= delay <= retry_at - made + 0.05
    eventually(lambda: d.outcomes, "the abandoned delivery's outcome")
    assert not d.outcomes[0].ok and "abandoned at shutdown" in d.outcomes[0].detail


def test_client_errors_are_not_retried(webhook_server):
    """HTTP 400 (bad payload, revoked hook) will not get better: one attempt only."""
    webhook_server.statuses.extend([400] * 5)
    d = Dispatch([webhook_server.url("slack")], max_retries=3)
    d.dispatcher.submit(alert())
    eventually(lambda: d.outcomes, "the delivery outcome")
    d.close()
    assert len(webhook_server.received) == 1 and not d.outcomes[0].ok


def test_feishu_refusal_in_body_is_a_failure(webhook_server):
    """HTTP 200 with a non-zero Feishu code (e.g. keyword filter) counts as not delivered."""
    webhook_server.reply = b'{"code":19024,"msg":"Key Words Not Found"}'
    d = Dispatch([webhook_server.url("feishu")])
    d.dispatcher.submit(alert())
    eventually(lambda: d.outcomes, "the delivery outcome")
    d.close()
    assert not d.outcomes[0].ok and "19024" in d.outcomes[0].detail


def test_dead_receiver_fails_in_the_background(dead_url, caplog):
    """Connection refused: submit returns at once, the failure and retries land in the log."""
    caplog.set_level(logging.INFO, logger="clipforge.alerts")
    d = Dispatch([dead_url], max_retries=1)
    d.dispatcher.submit(alert())
    eventually(lambda: d.outcomes, "the delivery outcome")
    d.close()
    assert not d.outcomes[0].ok and d.outcomes[0].attempts == 2
    assert "refused" in caplog.text.lower()
    assert SECRET not in caplog.text


def test_submit_does_not_wait_for_a_slow_receiver(webhook_server):
    """While the receiver holds the request (until released), submit has already returned."""
    webhook_server.held = True
    d = Dispatch([webhook_server.url()])
    d.dispatcher.submit(alert())
    assert webhook_server.num_answered == 0 and not d.outcomes  # returned before any answer
    webhook_server.wait_for(1)
    webhook_server.release.set()
    eventually(lambda: d.outcomes, "the delivery outcome")
    d.close()
    assert d.outcomes[0].ok


def test_full_queue_drops_the_oldest_with_a_counted_warning(webhook_server, caplog):
    """With the worker stuck on one request and queue_size=2, two more submissions push out the
    two oldest waiting messages; the newest ones are delivered."""
    caplog.set_level(logging.WARNING, logger="clipforge.alerts")
    webhook_server.held = True
    d = Dispatch([webhook_server.url()], queue_size=2)
    d.dispatcher.submit(alert(step=0))
    webhook_server.wait_for(1)  # step 0 is in flight, the queue is empty
    for step in (1, 2, 3, 4):
        d.dispatcher.submit(alert(step=step))
    assert d.dispatcher.num_dropped == 2
    assert "dropped the oldest message (non_finite, step 1); 1 dropped so far" in caplog.text
    assert "(non_finite, step 2); 2 dropped so far" in caplog.text
    webhook_server.release.set()
    webhook_server.wait_for(3)
    d.close()
    assert [r.body["step"] for r in webhook_server.received] == [0, 3, 4]


def test_close_flushes_queued_messages(webhook_server):
    """Messages queued before close (e.g. "run finished") are delivered before close returns."""
    d = Dispatch([webhook_server.url()])
    for step in range(3):
        d.dispatcher.submit(alert(step=step))
    d.close()
    assert len(webhook_server.received) == 3 and all(o.ok for o in d.outcomes)


def test_close_gives_up_on_a_stuck_receiver(webhook_server, caplog):
    """A receiver that never answers (held until the test ends): close returns after its
    timeout and logs how many messages were left undelivered."""
    caplog.set_level(logging.WARNING, logger="clipforge.alerts")
    webhook_server.held = True
    d = Dispatch([webhook_server.url()])
    d.dispatcher.submit(alert(step=0))
    d.dispatcher.submit(alert(step=1))
    webhook_server.wait_for(1)
    d.close(timeout=0.2)
    assert webhook_server.num_answered == 0, "close returned before the receiver answered"
    assert "2 message(s) to generic:http://127.0.0.1/…(redacted)" in caplog.text
