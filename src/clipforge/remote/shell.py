"""Running commands on a host: quiet, never reading the local terminal, failures made clear."""
from __future__ import annotations

import shlex
from typing import Iterable

from fabric import Connection

from clipforge.remote.errors import RemoteError
from clipforge.remote.hosts import label


def q(value: str) -> str:
    return shlex.quote(str(value))


def join(argv: Iterable[str]) -> str:
    return " ".join(q(a) for a in argv)


def run(cxn: Connection, command: str, *, what: str, **kwargs):
    """Run `command`; RemoteError naming `what` failed, with the tail of its output."""
    result = probe(cxn, command, **kwargs)
    if not result.ok:
        output = (result.stderr.strip() or result.stdout.strip()).splitlines()[-8:]
        raise RemoteError(f"{label(cxn)}: {what} failed (exit {result.exited}):\n  "
                          + "\n  ".join(output or ["(no output)"]))
    return result


def probe(cxn: Connection, command: str, **kwargs):
    """Run `command` and return its result whatever its exit code."""
    kwargs.setdefault("hide", True)
    kwargs.setdefault("in_stream", False)
    return cxn.run(command, warn=True, **kwargs)
