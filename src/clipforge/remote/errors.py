"""The one exception type the tasks turn into a clear message and a non-zero exit."""
from __future__ import annotations


class RemoteError(RuntimeError):
    """A problem the user can fix (bad option, unreachable host, dirty tree...); the message says
    what is wrong and what to do. Printed without a traceback."""
