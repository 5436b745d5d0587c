"""Request bodies for each kind of webhook, and how each kind says "accepted".

- Feishu/Lark custom bot: `{"msg_type": "text", "content": {"text": ...}}`. Feishu answers
  HTTP 200 even when it rejects a message (bad keyword, bad signature, frequency limit) and
  puts the verdict in the body: `{"code": 0, "msg": "success", ...}` means accepted (older
  deployments answer `{"StatusCode": 0, ...}`).
- Slack incoming webhook: `{"text": ...}` plus Block Kit `blocks`; `text` is then the
  notification fallback. Slack answers `ok` with HTTP 200, errors with HTTP 4xx.
- Generic JSON: the alert's fields, for any receiver (Alertmanager-style relays, n8n, ...).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from clipforge.alerts.events import Alert

_SLACK_EMOJI = {
    "info": ":information_source:",
    "warning": ":warning:",
    "critical": ":rotating_light:",
}


def build_payload(kind: str, alert: Alert) -> dict[str, object]:
    if kind == "feishu":
        return feishu_payload(alert)
    if kind == "slack":
        return slack_payload(alert)
    if kind == "generic":
        return generic_payload(alert)
    raise ValueError(f"unknown webhook kind {kind!r}")


def feishu_payload(alert: Alert) -> dict[str, object]:
    return {"msg_type": "text", "content": {"text": alert.summary()}}


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
    if kind != "feishu":
        return True, f"HTTP {status}"
    try:
        reply = json.loads(body.decode("utf-8") or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False, f"HTTP {status} with a reply that is not JSON"
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
