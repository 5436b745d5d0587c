"""The user-error type: a problem the user can fix (a bad param, a missing input, an unreachable
host), raised where it is found, with a message that says what is wrong and what to do.

Every command line (the stages' `cli.run_stage`, the Fabric tasks) prints a UserError as one line
per line of its message and exits without a traceback; anything else is a bug and keeps its
traceback. So nothing catches ValueError or OSError wholesale to relabel it as a UserError: the
check that finds the problem raises it. Standard library only: the GPU host side imports it.
"""


class UserError(Exception):
    """A problem the user can fix; its message is what the user reads."""


class StageError(UserError, RuntimeError):
    """A problem with the inputs of a pipeline stage (data, train, eval)."""


def shown(value: object, max_chars: int = 100) -> str:
    """`value` as an error message quotes what came from outside (a host, a store, a file): its
    repr, so a newline or an escape sequence cannot forge another line, cut to `max_chars`."""
    text = repr(value)
    return text if len(text) <= max_chars else f"{text[:max_chars]}… ({len(text)} characters)"
