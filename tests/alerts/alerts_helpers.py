"""A real webhook receiver on 127.0.0.1 and small helpers shared by the alerts tests.

A module of its own rather than conftest.py, so that tests import it under a unique name.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from clipforge.alerts.config import AlertsConfig
from tests.support.wait import wait_for

# The secret part of every test URL: it must never show up in a log, event or repr.
SECRET = "SECRET-9f3a61c2-token"
# A safety limit for waits that end on an event (tests normally pass in milliseconds), never a
# speed assertion: also the HTTP and flush timeouts of fast_config, which a test never reaches.
WAIT_SECONDS = 60.0


@dataclass(frozen=True)
class Received:
    path: str
    content_type: str
    body: dict


class WebhookServer:
    """Records every POST; answers with scripted statuses (default 200), and with `retry_after`
    as the Retry-After header of every error reply when it is set. With `held` set, every request
    waits until `release` is set (or the server stops); `hold_seconds` holds each for a while."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.received: list[Received] = []
        self.num_answered = 0
        self.statuses: deque[int] = deque()
        self.reply = b'{"code":0,"msg":"success","data":{}}'
        self.held = False
        self.hold_seconds = 0.0
        self.retry_after: str | None = None
        self.release = threading.Event()
        self._cond = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with server._cond:
                    server.received.append(
                        Received(self.path, self.headers["Content-Type"], json.loads(body))
                    )
                    status = server.statuses.popleft() if server.statuses else 200
                    server._cond.notify_all()
                if server.held:
                    server.release.wait()
                elif server.hold_seconds:
                    server.release.wait(server.hold_seconds)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if status >= 400 and server.retry_after is not None:
                    self.send_header("Retry-After", server.retry_after)
                self.end_headers()
                self.wfile.write(server.reply)
                with server._cond:
                    server.num_answered += 1

            def log_message(self, *args) -> None:  # keep pytest output quiet
                pass

        self._httpd = ThreadingHTTPServer((host, 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def url(self, kind: str = "") -> str:
        host, port = self._httpd.server_address[:2]
        url = f"http://{host}:{port}/open-apis/bot/v2/hook/{SECRET}"
        return f"{kind}:{url}" if kind else url

    def wait_for(self, count: int) -> list[Received]:
        with self._cond:
            self._cond.wait_for(lambda: len(self.received) >= count, timeout=WAIT_SECONDS)
            assert len(self.received) >= count, (
                f"got {len(self.received)} requests, expected {count}"
            )
            return list(self.received)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.release.set()
        self._httpd.shutdown()
        self._httpd.server_close()


def fast_config(**overrides) -> AlertsConfig:
    """Defaults scaled down so that retries and flushes take milliseconds."""
    values = dict(
        retry_backoff_seconds=0.01,
        http_timeout_seconds=WAIT_SECONDS,
        flush_timeout_seconds=WAIT_SECONDS,
        loss_spike_warmup_steps=3,
    )
    values.update(overrides)
    return AlertsConfig(**values)


def eventually(predicate, what: str) -> None:
    wait_for(predicate, what=what, timeout=WAIT_SECONDS, interval=0.01)
