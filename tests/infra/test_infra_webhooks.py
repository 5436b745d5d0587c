"""The stack's alertWebhooks is checked with the grammar training reads CLIPFORGE_ALERT_WEBHOOKS
with (clipforge.alerts.targets), so `make up` accepts every entry a run would use and no other."""

from __future__ import annotations

import pulumi
import pytest
from infra_harness import program_values, reveal, run_program, stack_config

from clipforge.alerts.targets import parse_targets
from clipforge_infra.contract import ALERT_WEBHOOKS_ENV
from clipforge_infra.settings import StackConfigError, parse_settings

LARK = "lark:https://open.larksuite.com/open-apis/bot/v2/hook/abc"
ACCEPTED = (
    "feishu:https://open.feishu.cn/open-apis/bot/v2/hook/abc",
    LARK,
    " Slack:https://hooks.slack.com/services/T0/B0/x ",
    "https://hooks.example.org/x",
    "http://10.0.0.5:8080/alerts",
)
REJECTED = (
    "teams:https://example.webhook.office.com/x",
    "feishu:ftp://open.feishu.cn/hook",
    "slack:hooks.slack.com/services/T0/B0/x",
    "https://",
    "not-a-url-but-a-token",
    "https://hooks.example.org/x;secret=only-for-signed-bots",
)


def runtime_accepts(entry: str) -> bool:
    try:
        parse_targets([entry], source="CLIPFORGE_ALERT_WEBHOOKS")
    except ValueError:
        return False
    return True


def stack_accepts(entry: str) -> bool:
    config, secret_keys = stack_config("example-1x4", secrets={"alertWebhooks": entry})
    try:
        parse_settings(program_values(config, secret_keys), secret_keys)
    except StackConfigError as error:
        assert "clipforge-infra:alertWebhooks: entry 1" in str(error)
        return False
    return True


@pytest.mark.parametrize("entry", ACCEPTED)
def test_stack_accepts_every_entry_training_accepts(entry):
    """An entry a run would deliver to (lark: included) passes `make up`'s check."""
    assert runtime_accepts(entry) and stack_accepts(entry)


@pytest.mark.parametrize("entry", REJECTED)
def test_stack_rejects_every_entry_training_rejects(entry):
    """An entry a run would refuse stops `make up` too, naming its position only."""
    assert not runtime_accepts(entry) and not stack_accepts(entry)


def test_make_up_passes_a_lark_webhook_to_the_workers():
    """`lark:URL` (Feishu's international name, documented in docs/alerts.md) reaches the alerts
    Secret the workers read, instead of stopping `make up`."""
    config, secret_keys = stack_config("example-1x4", secrets={"alertWebhooks": LARK})
    run = run_program(config, secret_keys)
    secrets = [reveal(r.inputs["stringData"]) for r in run.of_type("kubernetes:core/v1:Secret")]
    assert {ALERT_WEBHOOKS_ENV: LARK} in secrets


def test_a_malformed_lark_entry_is_still_refused():
    """`lark:` with no http(s) URL behind it stops the program, naming the entry's position only."""
    config, secret_keys = stack_config(
        "example-1x4", secrets={"alertWebhooks": "lark:secret-token-9"}
    )
    with pytest.raises(pulumi.RunError) as raised:
        run_program(config, secret_keys)
    assert "clipforge-infra:alertWebhooks: entry 1" in str(raised.value)
    assert "secret-token-9" not in str(raised.value)
