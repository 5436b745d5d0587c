"""Feishu/Lark, DingTalk and WeCom group bots: each gets its own message format, signed bots
get a signature their service accepts, and the signing secret never shows in an output.

The receivers on 127.0.0.1 check signatures with the services' documented recipes, written
out again in the test helper (not imported from clipforge), so a wrong recipe fails here."""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest

from clipforge.alerts.delivery import WebhookDispatcher
from clipforge.alerts.events import Alert
from clipforge.alerts.formats import build_request
from clipforge.alerts.targets import load_targets, parse_targets, redact
from tests.support.webhooks import SECRET, ChatBotServer, fast_config

LOG = logging.getLogger("clipforge.alerts.test")
SIGNING_SECRET = "SECabc123-signing-secret"


def alert(message: str = "loss is nan") -> Alert:
    return Alert(
        rule="non_finite",
        severity="warning",
        message=message,
        run_id="run-1",
        step=7,
        time=1_700_000_000.0,
        host="node-0",
    )


@pytest.fixture
def bot(request):
    kind, secret = request.param
    server = ChatBotServer(kind, secret)
    server.start()
    yield server
    server.stop()


def deliver(entries, *alerts):
    outcomes = []
    dispatcher = WebhookDispatcher(
        parse_targets(entries, source="test"), fast_config(), log=LOG, on_outcome=outcomes.append
    )
    dispatcher.start()
    for one in alerts:
        dispatcher.submit(one)
    dispatcher.close(3.0)
    return outcomes


@pytest.mark.parametrize(
    "bot",
    [
        ("feishu", ""),
        ("feishu", SIGNING_SECRET),
        ("dingtalk", ""),
        ("dingtalk", SIGNING_SECRET),
        ("wecom", ""),
    ],
    indirect=True,
    ids=["feishu", "feishu-signed", "dingtalk", "dingtalk-signed", "wecom"],
)
def test_each_bot_accepts_our_message(bot):
    """The bot takes the message in its format (and, signed, with a valid signature)."""
    outcomes = deliver([bot.entry()], alert())
    assert bot.refused == [] and len(bot.accepted) == 1
    assert [(o.ok, o.attempts) for o in outcomes] == [(True, 1)]


@pytest.mark.parametrize(
    "bot",
    [("feishu", SIGNING_SECRET), ("dingtalk", SIGNING_SECRET)],
    indirect=True,
    ids=["feishu", "dingtalk"],
)
def test_a_wrong_secret_is_refused_and_reported_without_the_secret(bot, caplog):
    """Signed with another secret, the bot refuses (HTTP 200 and an error code); the outcome
    says so, not retried, and neither secret appears in it or the log."""
    caplog.set_level(logging.INFO, logger="clipforge.alerts")
    outcomes = deliver([bot.entry(secret="SECwrong-one")], alert())
    assert bot.accepted == [] and len(bot.refused) == 1
    assert [(o.ok, o.attempts) for o in outcomes] == [(False, 1)]
    assert "refused it" in outcomes[0].detail
    for text in (outcomes[0].summary(), caplog.text):
        assert "SECwrong-one" not in text and SECRET not in text and SIGNING_SECRET not in text


@pytest.mark.parametrize(
    "bot",
    [("feishu", SIGNING_SECRET), ("dingtalk", SIGNING_SECRET)],
    indirect=True,
    ids=["feishu", "dingtalk"],
)
def test_a_signature_older_than_an_hour_is_refused(bot):
    """The timestamp is part of the signature and checked: a request signed two hours ago
    (e.g. replayed) fails, which is why every retry is signed afresh."""
    (target,) = parse_targets([bot.entry()], source="test")
    url, payload = build_request(target, alert(), now_seconds=bot._clock() - 7200)
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=5) as response:
        reply = json.loads(response.read())
    assert reply.get("code", reply.get("errcode")) != 0
    assert len(bot.refused) == 1 and "within one hour" in bot.refused[0]


@pytest.mark.parametrize("bot", [("wecom", "")], indirect=True, ids=["wecom"])
def test_a_long_message_is_cut_to_fit_wecom(bot):
    """WeCom refuses markdown over 4096 bytes: a long (multi-byte) message is cut, not lost."""
    deliver([bot.entry()], alert(message="显存不足 " * 2000))
    assert len(bot.accepted) == 1


def test_secret_in_an_entry_is_kept_apart_and_redacted(tmp_path):
    """`kind:URL;secret=S` gives the URL without the secret; the label says "signed" and shows
    neither; redact() removes the secret and DingTalk's query token from any text."""
    url = f"https://oapi.dingtalk.com/robot/send?access_token={SECRET}"
    path = tmp_path / "hooks"
    path.write_text(f"dingtalk:{url};secret={SIGNING_SECRET}\n")
    path.chmod(0o600)
    (target,) = load_targets({"CLIPFORGE_ALERT_WEBHOOKS_FILE": str(path)})
    assert (target.kind, target.url, target.secret) == ("dingtalk", url, SIGNING_SECRET)
    assert target.label.startswith("signed dingtalk:https://oapi.dingtalk.com/")
    for text in (repr(target), target.label):
        assert SECRET not in text and SIGNING_SECRET not in text
    cleaned = redact(f"error at access_token={SECRET} with {SIGNING_SECRET}", [target])
    assert SECRET not in cleaned and SIGNING_SECRET not in cleaned


@pytest.mark.parametrize(
    "entry",
    [
        f"wecom:https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key={SECRET};secret=x",
        f"slack:https://hooks.slack.com/services/{SECRET};secret=x",
        f"feishu:https://open.feishu.cn/open-apis/bot/v2/hook/{SECRET};secret=",
    ],
)
def test_a_secret_where_none_can_be_used_is_refused_without_quoting(entry):
    """Only Feishu/Lark and DingTalk sign; an empty secret is a mistake too."""
    with pytest.raises(ValueError, match="entry 1") as error:
        parse_targets([entry], source="test")
    assert SECRET not in str(error.value)
