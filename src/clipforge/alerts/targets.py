"""Webhook targets, read from the environment or a secret file, and kept out of every output.

A webhook URL is a credential: whoever has it can post into the team's chat. It is read from
`CLIPFORGE_ALERT_WEBHOOKS` (comma-separated) and/or the file named by
`CLIPFORGE_ALERT_WEBHOOKS_FILE` (one entry per line or comma-separated, `#` starts a comment),
which other users may not read (its mode is checked as ssh checks a private key's).
Each entry is `feishu:URL`, `lark:URL` (same format as Feishu), `dingtalk:URL`, `wecom:URL`,
`slack:URL`, or a bare URL (generic JSON). A Feishu/Lark or DingTalk bot with signature
verification on takes its signing secret in the same entry, `feishu:URL;secret=SECRET`: it
travels exactly like the URL (the variable, the file, the Kubernetes Secret) and is never in
params.yaml, a command line or an output. Anything that is printed shows `WebhookTarget.label`
instead: the kind, the host and a short hash, enough to tell two targets apart and never
enough to use one.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import stat
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from clipforge.errors import UserError
from clipforge.util import short_repr

ENV_WEBHOOKS = "CLIPFORGE_ALERT_WEBHOOKS"
ENV_WEBHOOKS_FILE = "CLIPFORGE_ALERT_WEBHOOKS_FILE"
# What the secrets file's mode may not allow: anything for other users, writing for the group.
# The group may read it: a Kubernetes Secret mounted with an fsGroup is 0440.
SECRET_FILE_FORBIDDEN_MODE = 0o027

KINDS = ("feishu", "dingtalk", "wecom", "slack", "generic")
_PREFIXES = {
    "feishu": "feishu",
    "lark": "feishu",
    "dingtalk": "dingtalk",
    "wecom": "wecom",
    "slack": "slack",
}
# The services whose bots check a signature made with a secret of their own; WeCom's group bot
# has none (its key is in the URL), Slack's is for apps, not incoming webhooks.
SIGNED_KINDS = ("feishu", "dingtalk")
_SECRET_MARK = ";secret="


class WebhookError(UserError, ValueError):
    """A webhook entry or file that cannot be used; the message never shows the entry."""


@dataclass(frozen=True)
class WebhookTarget:
    kind: str
    """"feishu", "slack" or "generic"."""
    url: str = field(repr=False)
    secret: str = field(default="", repr=False)
    """The bot's signing secret ("" for none): messages are then signed (see formats.py)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WebhookError(f"webhook kind must be one of {KINDS}, got {short_repr(self.kind)}")
        if self.secret and self.kind not in SIGNED_KINDS:
            raise WebhookError(f"a {self.kind} webhook takes no signing secret")

    @property
    def label(self) -> str:
        """Printable stand-in for the URL, e.g. `feishu:https://open.feishu.cn/…#1a2b3c4d`."""
        parts = urllib.parse.urlsplit(self.url)
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:8]
        signed = "signed " if self.secret else ""
        return f"{signed}{self.kind}:{parts.scheme}://{parts.hostname}/…(redacted)#{digest}"

    def __repr__(self) -> str:
        return f"WebhookTarget({self.label})"

    __str__ = __repr__


def load_targets(environ: Mapping[str, str] = os.environ) -> list[WebhookTarget]:
    """All targets named by the environment variable and the secret file; none is fine."""
    targets: list[WebhookTarget] = []
    inline = environ.get(ENV_WEBHOOKS, "")
    targets += parse_targets(inline.split(","), source=ENV_WEBHOOKS)
    path = environ.get(ENV_WEBHOOKS_FILE, "")
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError as error:
            raise WebhookError(
                f"{ENV_WEBHOOKS_FILE} names {short_repr(path)}, which cannot be read "
                f"({error.strerror}); "
                f"fix the path or unset {ENV_WEBHOOKS_FILE}"
            ) from None
        if mode & SECRET_FILE_FORBIDDEN_MODE:
            raise WebhookError(
                f"{ENV_WEBHOOKS_FILE} names {path!r}, whose mode {mode:04o} lets other users "
                f"{'read' if mode & 0o004 else 'change'} the webhooks in it; "
                f"`chmod 600 {shlex.quote(path)}` (as ssh refuses such a private key)"
            )
        entries = [
            entry for line in text.splitlines() for entry in line.split("#", 1)[0].split(",")
        ]
        targets += parse_targets(entries, source=f"{ENV_WEBHOOKS_FILE} ({path})")
    # The same URL given twice (env and file) would send every alert twice.
    return list(dict.fromkeys(targets))


def parse_targets(entries: Iterable[str], *, source: str | None) -> list[WebhookTarget]:
    """Parse `kind:URL` / bare-URL entries; blank entries are skipped. The one grammar of an
    entry: the stack's alertWebhooks (infra/) is checked with it too.

    Errors name the entry's position and what is wrong, never the entry itself: a slightly
    mistyped secret is still a secret. `source` (where the entries came from) leads the message;
    None leaves it to the caller.
    """
    targets = []
    for position, raw in enumerate(entries, start=1):
        entry = raw.strip()
        if not entry:
            continue
        where = (f"{source}: " if source else "") + f"entry {position}"
        kind, url = _split_kind(entry)
        url, mark, secret = url.partition(_SECRET_MARK)
        parts = urllib.parse.urlsplit(url)
        if kind is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise WebhookError(
                f"{where} is not `feishu:URL`, `lark:URL`, `dingtalk:URL`, `wecom:URL`, "
                f"`slack:URL` or an http(s) URL, optionally followed by `;secret=SECRET` "
                f"(the entry is not shown because it may be a secret)"
            )
        if mark and (kind not in SIGNED_KINDS or not secret.strip()):
            raise WebhookError(
                f"{where}: `;secret=` needs a non-empty secret and is only for "
                f"{' and '.join(SIGNED_KINDS)} bots (the entry is not shown)"
            )
        targets.append(WebhookTarget(kind=kind, url=url, secret=secret.strip()))
    return targets


def _split_kind(entry: str) -> tuple[str | None, str]:
    prefix, _, rest = entry.partition(":")
    prefix = prefix.strip().lower()
    if prefix in ("http", "https"):
        return "generic", entry
    if prefix in _PREFIXES:
        return _PREFIXES[prefix], rest.strip()
    return None, entry


def redact(text: str, targets: Iterable[WebhookTarget]) -> str:
    """Replace any target URL (or its secret path) inside `text` with the target's label.

    Used on every string that comes from outside our code (exception texts, server replies)
    before it is logged: they could quote the URL back.
    """
    for target in targets:
        text = text.replace(target.url, target.label)
        if target.secret:
            text = text.replace(target.secret, "…(redacted secret)")
        parts = urllib.parse.urlsplit(target.url)
        # DingTalk and WeCom keep their token in the query (access_token=, key=), not the path.
        if parts.query:
            text = text.replace(parts.query, "…(redacted)")
        if len(parts.path) > 1:
            text = text.replace(parts.path, "/…(redacted)")
    return text
