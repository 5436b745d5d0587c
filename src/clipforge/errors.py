"""The user-error type: a problem the user can fix, said in one line.

A problem the user can fix (a bad param, a missing input, an unreachable
host), raised where it is found, with a message that says what is wrong and what to do.

Every command line (the stages' `cli.run_stage`, the Fabric tasks) prints a UserError as one line
per line of its message and exits without a traceback; anything else is a bug and keeps its
traceback. So nothing catches ValueError or OSError wholesale to relabel it as a UserError: the
check that finds the problem raises it. Standard library only: the GPU host side imports it.
"""


class UserError(Exception):
    """A problem the user can fix; its message is what the user reads.

    `fault`: what kind of fault it is for a supervisor that would restart the stage
    (clipforge.fault_record): every user error repeats the same way on a restart unless its type
    says otherwise (None: a restart may find it gone, as a lock held by a trainer that ends)."""

    fault: str | None = "input"

    def __init__(self, message: str = "", *, step: int | None = None):
        super().__init__(message)
        self.step = step  # the run's last step when it was raised, where the raiser knows it


class StageError(UserError, RuntimeError):
    """A problem with the inputs of a pipeline stage (data, train, eval)."""


class DiskFull(StageError):
    """No room for what a stage must write: freeing space is the user's to do."""

    fault = "disk_full"


class AccessDenied(StageError):
    """A file or folder of the run this process may not read or write (mode, owner)."""

    fault = "permission"


class StackMismatch(StageError):
    """The software stack cannot run the stage (a library missing or of another version)."""

    fault = "stack"


class LauncherError(UserError, RuntimeError):
    """A problem with a launch the user can fix (bad option, unreachable host, dirty tree...);
    the Fabric tasks print it as one line, without a traceback, and exit 1."""
