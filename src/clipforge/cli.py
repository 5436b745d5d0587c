"""What every `python -m clipforge.<stage>` shares: --params/--set parsing and error exits."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from clipforge.config import Params, load_params
from clipforge.errors import UserError
from clipforge.fault_record import record_fault
from clipforge.fields import path_problem
from clipforge.fsutil import restrict_umask

EXIT_USAGE = 2

P = TypeVar("P", bound=Params)


# `--set`'s example in each stage's --help: a key of the section that stage reads.
SET_EXAMPLES = {"data": "data.num_train=1000", "eval": "eval.batch_size=256"}


def stage_parser(prog: str, description: str) -> argparse.ArgumentParser:
    example = SET_EXAMPLES.get(prog.rsplit(".", 1)[-1], "train.lr=1e-4")
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--params",
        default="params.yaml",
        type=path_argument,
        help="params file (default: params.yaml)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a parameter, e.g. --set {example} (repeatable; the value "
        "is YAML, as with `dvc exp run -S`)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the params this stage would run with (params file, --set), "
        "checked, as YAML; then exit",
    )
    return parser


def path_argument(text: str) -> str:
    """The type of a stage's path options: the rule of the params' paths (fields.path_problem),
    so a name the OS refuses is argparse's one line, not a traceback at its first use."""
    problem = path_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def run_stage(
    prog: str,
    body: Callable[[argparse.Namespace], None],
    argv: Sequence[str] | None,
    parser: argparse.ArgumentParser,
    params: type[Params],
) -> int:
    """Parse, run, and turn user errors (clipforge.errors.UserError, and only those: a bug keeps
    its traceback) into one clear line per problem (a test set may have several) and exit 2,
    recorded for the supervisor when it runs the stage (clipforge.fault_record).
    `params`: what the stage reads of params.yaml (what --print-config shows)."""
    args = parser.parse_args(argv)
    configure_logging()
    umask = restrict_umask()  # what the stage writes is group-readable at most (clipforge.fsutil)
    try:
        if args.print_config:
            print(load_stage_config(args, params).to_yaml(), end="")
            return 0
        body(args)
    except UserError as exc:
        for line in str(exc).splitlines():
            print(f"{prog}: error: {line}", file=sys.stderr)
        record_fault(exc)
        return EXIT_USAGE
    finally:
        os.umask(umask)  # a caller's own (a test calling main in its process)
    return 0


@contextlib.contextmanager
def exit_on_stop_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT end the process through SystemExit(128 + signal), so
    `finally` blocks and context managers clean up (a half-written output, a child process group)
    instead of the process dying where it stands."""
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def load_stage_config(args: argparse.Namespace, params: type[P]) -> P:
    """The params of a stage (--params, --set): the sections it reads, checked."""
    return load_params(params, args.params, args.overrides)


def configure_logging() -> None:
    """clipforge's own messages at INFO; libraries (open_clip logs every step of model creation
    at INFO on the root logger) only from WARNING."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    logging.getLogger("clipforge").setLevel(logging.INFO)
