"""A real webhook receiver on 127.0.0.1 and small helpers shared by the alerts tests, the
launcher's and the training runs' that alert."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
import urllib.parse
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


class ChatBotServer:
    """A Feishu/Lark, DingTalk or WeCom group bot on 127.0.0.1, checking requests the way each
    service documents: the token in the URL, the message's shape, and (with `signing_secret`)
    the signature and its timestamp's one-hour window. It answers as the service does: HTTP 200
    with the service's verdict in the body (Feishu `code`, DingTalk/WeCom `errcode`)."""

    PATHS = {
        "feishu": f"/open-apis/bot/v2/hook/{SECRET}",
        "dingtalk": f"/robot/send?access_token={SECRET}",
        "wecom": f"/cgi-bin/webhook/send?key={SECRET}",
    }

    def __init__(self, kind: str, signing_secret: str = "", *, clock=time.time) -> None:
        self.kind, self.signing_secret, self._clock = kind, signing_secret, clock
        self.accepted: list[dict] = []
        self.refused: list[str] = []
        self._cond = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                why = server._check(self.path, body)
                with server._cond:
                    (server.refused.append(why) if why else server.accepted.append(body))
                    server._cond.notify_all()
                reply = server._reply(why)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(reply).encode())

            def log_message(self, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def entry(self, secret: str | None = None) -> str:
        """The `kind:URL[;secret=...]` entry for this bot; `secret` overrides the right one."""
        host, port = self._httpd.server_address[:2]
        entry = f"{self.kind}:http://{host}:{port}{self.PATHS[self.kind]}"
        secret = self.signing_secret if secret is None else secret
        return f"{entry};secret={secret}" if secret else entry

    def wait_for_answers(self, count: int) -> None:
        with self._cond:
            self._cond.wait_for(
                lambda: len(self.accepted) + len(self.refused) >= count, timeout=WAIT_SECONDS
            )

    def _check(self, path: str, body: dict) -> str:
        parts = urllib.parse.urlsplit(path)
        query = urllib.parse.parse_qs(parts.query)
        expected = urllib.parse.urlsplit(self.PATHS[self.kind])
        if parts.path != expected.path:
            return "unknown bot"
        token_key = {"dingtalk": "access_token", "wecom": "key"}.get(self.kind)
        if token_key and query.get(token_key) != [SECRET]:
            return "bad token"
        if self.kind == "feishu":
            if body.get("msg_type") != "text" or "clipforge" not in body["content"]["text"]:
                return "bad message"
            if self.signing_secret:
                timestamp = body.get("timestamp", "")
                key = f"{timestamp}\n{self.signing_secret}".encode()
                want = base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()
                if body.get("sign") != want or abs(self._clock() - int(timestamp)) > 3600:
                    return "sign match fail or timestamp is not within one hour"
        elif self.kind == "dingtalk":
            markdown = body.get("markdown", {})
            if body.get("msgtype") != "markdown" or "clipforge" not in markdown.get("title", ""):
                return "bad message"
            if self.signing_secret:
                (timestamp,) = query.get("timestamp", [""])
                # parse_qs has already undone the URL-encoding of `sign`.
                (sign,) = query.get("sign", [""])
                message = f"{timestamp}\n{self.signing_secret}".encode()
                digest = hmac.new(self.signing_secret.encode(), message, hashlib.sha256).digest()
                if sign != base64.b64encode(digest).decode():
                    return "sign not match"
                if abs(self._clock() * 1000 - int(timestamp)) > 3600 * 1000:
                    return "timestamp is not within one hour"
        elif self.kind == "wecom":
            content = body.get("markdown", {}).get("content", "")
            if body.get("msgtype") != "markdown" or len(content.encode()) > 4096:
                return "bad message"
        return ""

    def _reply(self, why: str) -> dict:
        if self.kind == "feishu":
            return {"code": 19021, "msg": why} if why else {"code": 0, "msg": "success"}
        return {"errcode": 310000, "errmsg": why} if why else {"errcode": 0, "errmsg": "ok"}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
