"""The user-error type: a problem the user can fix, said in one line.

A problem the user can fix (a bad param, a missing input, an unreachable
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


class LauncherError(UserError, RuntimeError):
    """A problem with a launch the user can fix (bad option, unreachable host, dirty tree...);
    the Fabric tasks print it as one line, without a traceback, and exit 1."""
