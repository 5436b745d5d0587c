"""Request bodies of the three webhook kinds, and how each kind's reply is judged."""

from __future__ import annotations

import json

from clipforge.alerts.events import Alert
from clipforge.alerts.formats import accepted, build_payload, encode


def make_alert(**overrides) -> Alert:
    values = dict(
        rule="loss_spike",
        severity="warning",
        message="loss 9.1 is 4.0x its moving average",
        run_id="run-0123456789ab",
        launch_id="20231114-221320-abcdef12",
        step=1200,
        time=1_700_000_000.0,
        host="node-3",
        details={"loss": 9.1},
    )
    values.update(overrides)
    return Alert(**values)


def test_feishu_text_message_shape():
    """Feishu/Lark custom bot text message: exactly msg_type=text and content.text."""
    payload = build_payload("feishu", make_alert())
    assert set(payload) == {"msg_type", "content"}
    assert payload["msg_type"] == "text"
    assert set(payload["content"]) == {"text"}
    text = payload["content"]["text"]
    parts = ("clipforge", "WARNING", "loss_spike", "run-0123456789ab", "1200", "node-3", "4.0x")
    for part in (*parts, "20231114-221320-abcdef12"):
        assert part in text


def test_slack_message_has_fallback_text_and_valid_blocks():
    """Slack incoming webhook: top-level text (notification fallback) plus section/context blocks
    whose text objects are mrkdwn."""
    payload = build_payload("slack", make_alert(severity="critical"))
    assert isinstance(payload["text"], str) and "loss_spike" in payload["text"]
    types = [block["type"] for block in payload["blocks"]]
    assert types == ["section", "context"]
    section, context = payload["blocks"]
    assert section["text"]["type"] == "mrkdwn" and "CRITICAL" in section["text"]["text"]
    assert all(element["type"] == "mrkdwn" for element in context["elements"])
    context_text = context["elements"][0]["text"]
    assert (
        "run-0123456789ab" in context_text and "launch `20231114-221320-abcdef12`" in context_text
    )


def test_slack_escapes_control_sequences():
    """A message containing <!channel> cannot ping a whole Slack channel."""
    payload = build_payload("slack", make_alert(message="boom <!channel> & more"))
    as_text = json.dumps(payload)
    assert "<!channel>" not in as_text
    assert "&lt;!channel&gt;" in payload["blocks"][0]["text"]["text"]


def test_generic_json_fields():
    """Generic JSON carries rule, severity, message, run_id and launch_id (each its own id), step
    and an ISO-8601 UTC time."""
    payload = build_payload("generic", make_alert())
    assert payload["rule"] == "loss_spike"
    assert payload["severity"] == "warning"
    assert payload["message"].startswith("loss 9.1")
    assert payload["run_id"] == "run-0123456789ab"
    assert payload["launch_id"] == "20231114-221320-abcdef12"
    assert payload["step"] == 1200
    assert payload["time"] == "2023-11-14T22:13:20Z"


def test_non_finite_details_encode_as_strict_json():
    """A NaN loss in the details becomes the string "nan": the body stays valid JSON."""
    body = encode(build_payload("generic", make_alert(details={"loss": float("nan")})))
    assert json.loads(body)["details"] == {"loss": "nan"}


def test_feishu_reply_code_decides_acceptance():
    """Feishu answers HTTP 200 even when it refuses; code 0 (or legacy StatusCode 0) is success."""
    assert accepted("feishu", 200, b'{"code":0,"msg":"success"}')[0]
    assert accepted("feishu", 200, b'{"StatusCode":0,"StatusMessage":"success"}')[0]
    ok, detail = accepted("feishu", 200, b'{"code":19024,"msg":"Key Words Not Found"}')
    assert not ok and "19024" in detail


def test_http_status_decides_for_slack_and_generic():
    """Slack and generic receivers: 2xx accepted, anything else refused."""
    assert accepted("slack", 200, b"ok")[0]
    assert accepted("generic", 204, b"")[0]
    assert not accepted("slack", 404, b"no_service")[0]


def test_an_alert_without_a_launch_or_a_run_says_so():
    """A stage run without `fab train` has no launch id; a launch that failed before training
    saved anything has no run id: the field is null, and the text does not invent one."""
    payload = build_payload("generic", make_alert(launch_id=None, run_id=None))
    assert payload["launch_id"] is None and payload["run_id"] is None
    assert "(run - step 1200 on node-3)" in make_alert(launch_id=None, run_id=None).summary()
