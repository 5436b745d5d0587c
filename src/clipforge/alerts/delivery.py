"""Webhook delivery off the training thread: one bounded queue and one thread per target.

The training thread only appends to a deque; HTTP, retries and back-off happen on the target's
thread. A dead or slow target therefore never blocks training, and never delays the other
targets. When a queue is full the oldest message is dropped and counted: the newest alert is
the one that tells the current state. Threads are daemons, so a request stuck past its
timeout cannot keep a finished run's process alive.
"""

from __future__ import annotations

import datetime
import email.utils
import http.client
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence

from clipforge.alerts.config import AlertsConfig
from clipforge.alerts.events import Alert, DeliveryOutcome
from clipforge.alerts.formats import accepted, build_request, encode
from clipforge.alerts.targets import WebhookTarget, redact
from clipforge.util import backoff_seconds

# A server's Retry-After is honoured, within reason: it must not park the queue for hours.
_MAX_RETRY_AFTER_SECONDS = 60.0
_MAX_REPLY_BYTES = 64 * 1024


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    # urllib would follow a redirect of a POST as a GET without the body: a silent loss.
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


class WebhookDispatcher:
    """Fans each alert out to every target's worker; `submit` never blocks."""

    def __init__(
        self,
        targets: Sequence[WebhookTarget],
        config: AlertsConfig,
        *,
        log: logging.Logger,
        on_outcome: Callable[[DeliveryOutcome], None],
    ) -> None:
        self._workers = [_TargetWorker(t, targets, config, log, on_outcome) for t in targets]
        self._log = log

    @property
    def num_dropped(self) -> int:
        return sum(w.num_dropped for w in self._workers)

    def start(self) -> None:
        for worker in self._workers:
            worker.start()

    def submit(self, alert: Alert) -> None:
        for worker in self._workers:
            worker.submit(alert)

    def close(self, timeout_seconds: float) -> None:
        """Deliver what is queued, for at most `timeout_seconds` in all, then give up."""
        deadline = time.monotonic() + timeout_seconds
        for worker in self._workers:
            worker.finish()
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in self._workers:
            left = worker.abandon()
            if left:
                self._log.warning(
                    "alerts: %d message(s) to %s not delivered before shutdown "
                    "(alerts.flush_timeout_seconds=%g)",
                    left,
                    worker.target.label,
                    timeout_seconds,
                )


class _TargetWorker:
    def __init__(
        self,
        target: WebhookTarget,
        all_targets: Sequence[WebhookTarget],
        config: AlertsConfig,
        log: logging.Logger,
        on_outcome: Callable[[DeliveryOutcome], None],
    ) -> None:
        self.target = target
        self._all_targets = tuple(all_targets)
        self._config = config
        self._log = log
        self._on_outcome = on_outcome
        self._pending: deque[Alert] = deque()
        self._cond = threading.Condition()
        self._finishing = False
        self._abandoned = threading.Event()
        self._in_flight = False
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"alerts-{target.kind}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, alert: Alert) -> None:
        dropped = None
        with self._cond:
            if self._finishing:
                return
            if len(self._pending) >= self._config.queue_size:
                dropped = self._pending.popleft()
                self.num_dropped += 1
            self._pending.append(alert)
            self._cond.notify()
        if dropped is not None:
            self._log.warning(
                "alerts: queue to %s full (alerts.queue_size=%d): dropped the oldest message "
                "(%s, step %s); %d dropped so far",
                self.target.label,
                self._config.queue_size,
                dropped.rule,
                dropped.step,
                self.num_dropped,
            )

    def finish(self) -> None:
        with self._cond:
            self._finishing = True
            self._cond.notify()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def abandon(self) -> int:
        """Stop retrying; returns how many messages were left undelivered."""
        self._abandoned.set()
        with self._cond:
            left = len(self._pending) + (1 if self._in_flight else 0)
            self._pending.clear()
            self._cond.notify()
        return left

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._finishing:
                    self._cond.wait()
                if not self._pending:
                    return
                alert = self._pending.popleft()
                self._in_flight = True
            try:
                outcome = self._deliver(alert)
            except Exception as error:  # a bug here must not kill the thread silently
                outcome = DeliveryOutcome(
                    alert, self.target.label, False, 0, f"internal error: {error!r}"
                )
            with self._cond:
                self._in_flight = False
            self._report(outcome)

    def _deliver(self, alert: Alert) -> DeliveryOutcome:
        attempts_allowed = 1 + self._config.max_retries
        detail = ""
        for attempt in range(1, attempts_allowed + 1):
            url, payload = build_request(self.target, alert, now_seconds=time.time())
            ok, retryable, detail, retry_after = self._post(url, encode(payload))
            if ok:
                return DeliveryOutcome(alert, self.target.label, True, attempt, detail)
            if not retryable or attempt == attempts_allowed:
                return DeliveryOutcome(alert, self.target.label, False, attempt, detail)
            delay = backoff_seconds(attempt, self._config.retry_backoff_seconds)
            if retry_after is not None:
                delay = max(delay, min(retry_after, _MAX_RETRY_AFTER_SECONDS))
            self._log.warning(
                "alerts: sending %s (step %s) to %s failed, attempt %d of %d: %s; "
                "retrying in %.3g s",
                alert.rule,
                alert.step,
                self.target.label,
                attempt,
                attempts_allowed,
                detail,
                delay,
            )
            if self._abandoned.wait(delay):
                return DeliveryOutcome(
                    alert, self.target.label, False, attempt, f"{detail}; abandoned at shutdown"
                )
        raise AssertionError("unreachable")

    def _post(self, url: str, body: bytes) -> tuple[bool, bool, str, float | None]:
        """One attempt. Returns (accepted, worth retrying, detail, Retry-After seconds)."""
        request = urllib.request.Request(
            url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json; charset=utf-8",
                "User-Agent": "clipforge-alerts",
            },
        )
        try:
            with _OPENER.open(request, timeout=self._config.http_timeout_seconds) as response:
                ok, detail = accepted(
                    self.target.kind, response.status, response.read(_MAX_REPLY_BYTES)
                )
                return ok, False, self._clean(detail), None
        except urllib.error.HTTPError as error:
            retryable = error.code == 429 or error.code >= 500
            return False, retryable, f"HTTP {error.code}", _retry_after(error)
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
            # refused, DNS, timeout, reset, a garbled reply
            reason = getattr(error, "reason", error)
            return False, True, self._clean(f"{type(error).__name__}: {reason}"), None

    def _clean(self, text: str) -> str:
        return redact(text, self._all_targets)

    def _report(self, outcome: DeliveryOutcome) -> None:
        level = logging.INFO if outcome.ok else logging.ERROR
        self._log.log(level, "alerts: %s", outcome.summary())
        try:
            self._on_outcome(outcome)
        except Exception:  # the sink of outcomes is the monitor's; it must not stop delivery
            self._log.exception("alerts: recording a delivery outcome failed")


def _retry_after(error: urllib.error.HTTPError) -> float | None:
    """Seconds the server asks us to wait: Retry-After holds either seconds or an HTTP date."""
    value = error.headers.get("Retry-After") if error.headers else None
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None  # neither form: the exponential back-off will do
    if when.tzinfo is None:  # "-0000": a time in UTC from a sender that did not say its zone
        when = when.replace(tzinfo=datetime.timezone.utc)
    return (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
