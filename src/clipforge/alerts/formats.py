"""Requests for each kind of webhook (URL, body, signature), and how each kind says "accepted".

- Feishu/Lark custom bot: `{"msg_type": "text", "content": {"text": ...}}`. Feishu answers
  HTTP 200 even when it rejects a message (bad keyword, bad signature, frequency limit) and
  puts the verdict in the body: `{"code": 0, "msg": "success", ...}` means accepted (older
  deployments answer `{"StatusCode": 0, ...}`). With signature verification on, the body also
  carries `timestamp` (Unix seconds, a string) and `sign`: base64 of HMAC-SHA256 keyed with
  `"{timestamp}\n{secret}"` over an empty message (Feishu's documented recipe; the key, not
  the message, holds the secret). Feishu refuses a timestamp more than an hour off.
- DingTalk custom robot: `{"msgtype": "markdown", "markdown": {"title", "text"}}`. Signed
  robots take `timestamp` (Unix milliseconds) and `sign` as query parameters: base64 of
  HMAC-SHA256 keyed with the secret over `"{timestamp}\n{secret}"`, URL-encoded. The reply
  is HTTP 200 with `{"errcode": 0, "errmsg": "ok"}` when accepted.
- WeCom (WeChat Work) group bot: `{"msgtype": "markdown", "markdown": {"content"}}`, content
  at most 4096 bytes; no signing (the key in the URL is the credential). Reply as DingTalk's.
- Slack incoming webhook: `{"text": ...}` plus Block Kit `blocks`; `text` is then the
  notification fallback. Slack answers `ok` with HTTP 200, errors with HTTP 4xx.
- Generic JSON: the alert's fields, for any receiver (Alertmanager-style relays, n8n, ...).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import urllib.parse
from collections.abc import Mapping

from clipforge.alerts.events import Alert
from clipforge.alerts.targets import WebhookTarget

# WeCom refuses markdown content over 4096 bytes (errcode 40058); DingTalk documents no limit
# but long messages are cut by its clients, so both are kept under WeCom's.
_MAX_CHAT_BYTES = 4000
_CHAT_COLOURS = {"info": "info", "warning": "warning", "critical": "warning"}

_SLACK_EMOJI = {
    "info": ":information_source:",
    "warning": ":warning:",
    "critical": ":rotating_light:",
}


def build_request(
    target: WebhookTarget, alert: Alert, *, now_seconds: float
) -> tuple[str, dict[str, object]]:
    """The URL to POST to and the body, signed at `now_seconds` when the target has a secret.

    Called once per attempt: a retry after a back-off is signed afresh, so its timestamp is
    never older than the services' one-hour window allows.
    """
    payload = build_payload(target.kind, alert)
    url = target.url
    if target.secret and target.kind == "feishu":
        timestamp = str(int(now_seconds))
        payload = {"timestamp": timestamp, "sign": feishu_sign(target.secret, timestamp)}
        payload.update(build_payload(target.kind, alert))
    elif target.secret and target.kind == "dingtalk":
        timestamp = str(int(now_seconds * 1000))
        query = urllib.parse.urlencode(
            {"timestamp": timestamp, "sign": dingtalk_sign(target.secret, timestamp)}
        )
        url = f"{url}{'&' if urllib.parse.urlsplit(url).query else '?'}{query}"
    return url, payload


def feishu_sign(secret: str, timestamp: str) -> str:
    """Feishu/Lark: HMAC-SHA256 with key `timestamp\nsecret` over nothing, base64."""
    key = f"{timestamp}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()


def dingtalk_sign(secret: str, timestamp: str) -> str:
    """DingTalk: HMAC-SHA256 with key `secret` over `timestamp\nsecret`, base64 (the caller
    URL-encodes it as a query parameter)."""
    message = f"{timestamp}\n{secret}".encode()
    return base64.b64encode(hmac.new(secret.encode(), message, hashlib.sha256).digest()).decode()


def build_payload(kind: str, alert: Alert) -> dict[str, object]:
    if kind == "feishu":
        return feishu_payload(alert)
    if kind == "dingtalk":
        return dingtalk_payload(alert)
    if kind == "wecom":
        return wecom_payload(alert)
    if kind == "slack":
        return slack_payload(alert)
    if kind == "generic":
        return generic_payload(alert)
    raise ValueError(f"unknown webhook kind {kind!r}")


def feishu_payload(alert: Alert) -> dict[str, object]:
    return {"msg_type": "text", "content": {"text": alert.summary()}}


def dingtalk_payload(alert: Alert) -> dict[str, object]:
    # The title is what the notification shows; it starts with the keyword a keyword-secured
    # robot requires ("clipforge"), as the text does.
    title = f"[clipforge] {alert.severity.upper()} {alert.rule}"
    text = f"#### {title}\n\n{_chat_body(alert)}"
    return {"msgtype": "markdown", "markdown": {"title": title, "text": _cut_bytes(text)}}


def wecom_payload(alert: Alert) -> dict[str, object]:
    colour = _CHAT_COLOURS[alert.severity]
    head = f'[clipforge] <font color="{colour}">{alert.severity.upper()}</font> `{alert.rule}`'
    return {
        "msgtype": "markdown",
        "markdown": {"content": _cut_bytes(f"{head}\n{_chat_body(alert)}")},
    }


def _chat_body(alert: Alert) -> str:
    step = "-" if alert.step is None else str(alert.step)
    body = f"{alert.message}\n\n> run {alert.run_id} · step {step} · {alert.host}"
    if alert.num_suppressed:
        body += f"\n\n{alert.num_suppressed} similar alert(s) held back by the rate limit"
    return body


def _cut_bytes(text: str) -> str:
    encoded = text.encode("utf-8")
    if len(encoded) <= _MAX_CHAT_BYTES:
        return text
    return encoded[: _MAX_CHAT_BYTES - 3].decode("utf-8", errors="ignore") + "…"


def slack_payload(alert: Alert) -> dict[str, object]:
    step = "-" if alert.step is None else str(alert.step)
    headline = f"{_SLACK_EMOJI[alert.severity]} *{alert.severity.upper()}* `{alert.rule}`"
    launch = f" · launch `{_slack_escape(alert.launch_id)}`" if alert.launch_id else ""
    context = (
        f"run `{_slack_escape(alert.run_id or '-')}`{launch} · step {step} · "
        f"{_slack_escape(alert.host)}"
    )
    body = _slack_escape(alert.message)
    if alert.num_suppressed:
        body += f"\n_{alert.num_suppressed} similar alert(s) held back by the rate limit_"
    return {
        "text": _slack_escape(alert.summary()),
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"{headline}\n{body}"}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": context}]},
        ],
    }


def generic_payload(alert: Alert) -> dict[str, object]:
    return {
        "rule": alert.rule,
        "severity": alert.severity,
        "message": alert.message,
        "run_id": alert.run_id,
        "launch_id": alert.launch_id,
        "step": alert.step,
        "time": alert.iso_time,
        "host": alert.host,
        "key": alert.key,
        "num_suppressed": alert.num_suppressed,
        "details": _jsonable(alert.details),
    }


def encode(payload: Mapping[str, object]) -> bytes:
    # allow_nan=False: NaN is not JSON; _jsonable already turned non-finite floats into strings.
    return json.dumps(payload, ensure_ascii=False, allow_nan=False).encode("utf-8")


def accepted(kind: str, status: int, body: bytes) -> tuple[bool, str]:
    """Whether the receiver accepted the message (given a 2xx status), and why not."""
    if not 200 <= status < 300:
        return False, f"HTTP {status}"
    if kind not in ("feishu", "dingtalk", "wecom"):
        return True, f"HTTP {status}"
    try:
        reply = json.loads(body.decode("utf-8") or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False, f"HTTP {status} with a reply that is not JSON"
    if kind in ("dingtalk", "wecom"):  # both answer {"errcode": 0, "errmsg": "ok"}
        code = reply.get("errcode") if isinstance(reply, dict) else None
        if code == 0:
            return True, f"HTTP {status}, errcode 0"
        message = reply.get("errmsg", "") if isinstance(reply, dict) else ""
        service = "DingTalk" if kind == "dingtalk" else "WeCom"
        return False, f"HTTP {status} but {service} refused it: errcode {code} {message!s:.200}"
    code = reply.get("code", reply.get("StatusCode")) if isinstance(reply, dict) else None
    if code == 0:
        return True, f"HTTP {status}, code 0"
    message = reply.get("msg", reply.get("StatusMessage", "")) if isinstance(reply, dict) else ""
    return False, f"HTTP {status} but Feishu refused it: code {code} {message!s:.200}"


def _slack_escape(text: str) -> str:
    # Slack reads <...> as links and mentions (`<!channel>` pings everyone); & starts entities.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _jsonable(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
