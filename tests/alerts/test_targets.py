"""Webhook targets from the environment or a secret file, and their redaction."""

from __future__ import annotations

import pytest

from clipforge.alerts.targets import (
    ENV_WEBHOOKS,
    ENV_WEBHOOKS_FILE,
    WebhookError,
    WebhookTarget,
    load_targets,
    redact,
)
from tests.support.webhooks import SECRET

FEISHU = f"https://open.feishu.cn/open-apis/bot/v2/hook/{SECRET}"
SLACK = f"https://hooks.slack.com/services/T000/B000/{SECRET}"
GENERIC = f"https://relay.example.org/alerts/{SECRET}"


def test_env_entries_give_kind_and_url():
    """`feishu:`, `lark:`, `slack:` prefixes and a bare URL map to their kinds, URL intact."""
    env = {ENV_WEBHOOKS: f"feishu:{FEISHU}, slack:{SLACK},{GENERIC} ,lark:{FEISHU}x"}
    targets = load_targets(env)
    assert [(t.kind, t.url) for t in targets] == [
        ("feishu", FEISHU),
        ("slack", SLACK),
        ("generic", GENERIC),
        ("feishu", FEISHU + "x"),
    ]


def test_no_configuration_means_no_targets():
    """Without the variable or the file there is nothing to send to, and that is not an error."""
    assert load_targets({}) == []


def test_secret_file_lines_commas_and_comments(tmp_path):
    """The file takes one entry per line or comma-separated, skips `#` comments, merges with the
    variable, and drops a URL given twice."""
    path = tmp_path / "webhooks"
    path.write_text(f"# team chat\nfeishu:{FEISHU}\n\nslack:{SLACK}, {GENERIC}  # relay\n")
    path.chmod(0o600)
    env = {ENV_WEBHOOKS: f"feishu:{FEISHU}", ENV_WEBHOOKS_FILE: str(path)}
    assert [t.kind for t in load_targets(env)] == ["feishu", "slack", "generic"]


def test_unreadable_secret_file_names_variable_and_path(tmp_path):
    """A missing file is a clear error naming the variable and the path (a path is no secret)."""
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=ENV_WEBHOOKS_FILE) as error:
        load_targets({ENV_WEBHOOKS_FILE: str(missing)})
    assert str(missing) in str(error.value)


@pytest.mark.parametrize(
    "mode, allowed", [(0o600, True), (0o400, True), (0o640, True), (0o440, True), (0o644, False),
                      (0o604, False), (0o660, False), (0o602, False), (0o666, False)],
)  # fmt: skip
def test_a_secret_file_others_can_read_is_refused_as_ssh_refuses_a_key(tmp_path, mode, allowed):
    """Other users may not read the webhooks file, nor anyone but its owner change it: the
    error names the variable, the file, its mode and `chmod 600`; the group may read it (a
    Kubernetes Secret mounted with an fsGroup is 0440)."""
    path = tmp_path / "webhooks"
    path.write_text(f"feishu:{FEISHU};secret={SECRET}\n")
    path.chmod(mode)
    env = {ENV_WEBHOOKS_FILE: str(path)}
    if allowed:
        assert [t.kind for t in load_targets(env)] == ["feishu"]
        return
    with pytest.raises(WebhookError) as error:
        load_targets(env)
    message = str(error.value)
    assert f"{ENV_WEBHOOKS_FILE} names '{path}', whose mode {mode:04o}" in message
    assert f"chmod 600 {path}" in message and SECRET not in message
    assert "read" in message if mode & 0o004 else "change" in message


@pytest.mark.parametrize("entry", [f"teams:{FEISHU}", f"ftp://x.org/{SECRET}", f"slack:{SECRET}"])
def test_bad_entry_is_refused_without_quoting_it(entry):
    """An entry that is not kind:URL fails with its position, and the text never contains it."""
    with pytest.raises(ValueError, match="entry 2") as error:
        load_targets({ENV_WEBHOOKS: f"slack:{SLACK},{entry}"})
    assert SECRET not in str(error.value)


def test_repr_str_and_label_hide_the_secret():
    """repr/str/label show kind and host only; two URLs on one host get different labels."""
    target = WebhookTarget(kind="feishu", url=FEISHU)
    other = WebhookTarget(kind="feishu", url=FEISHU + "2")
    for text in (repr(target), str(target), target.label, repr([target])):
        assert SECRET not in text
        assert "open.feishu.cn" in text
    assert target.label != other.label


def test_redact_replaces_url_and_path():
    """Text quoting the whole URL or only its path loses the secret."""
    target = WebhookTarget(kind="slack", url=SLACK)
    text = f"POST {SLACK} failed; path was /services/T000/B000/{SECRET}"
    cleaned = redact(text, [target])
    assert SECRET not in cleaned
    assert target.label in cleaned
