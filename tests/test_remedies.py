"""Every command the project tells its users to run exists: no remedy points to nothing.

The messages are the string literals of src/, infra/, docker/*.py, fabfile.py and scripts/, and
the text of the Makefiles and shell scripts. A remedy is a command written at the start of a
`backticked`, 'quoted', "double-quoted" or (parenthesised) span: `make [-C DIR] TARGET`,
`fab [-H ...] TASK`, `dvc COMMAND [SUBCOMMAND]`, `python -m clipforge.MODULE`. Each is checked
against the real thing: make's own database of the Makefile (with its includes), the fabfile's
task collection, DVC's command-line parser, and the modules of the package.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO

PYTHON_SOURCES = ("src/**/*.py", "infra/**/*.py", "docker/*.py", "fabfile.py", "scripts/*.py")
TEXT_SOURCES = ("Makefile", "**/*.mk", "scripts/*.sh", "docker/*.sh")
_SPAN = re.compile(r"[`'\"(]\s*((?:make|fab|dvc|python3? -m)\b[^`'\"()\n]*)")
_COMMAND = re.compile(r"(?:^|\s)((?:make|fab|dvc|python3? -m)\b.*?)(?=\s(?:make|fab|dvc)\b|$)")
# Options of make and fab that take a value (the next word is not a target or task).
MAKE_VALUE_OPTIONS = ("-C", "-f", "-I", "-j", "-o", "-W")
FAB_VALUE_OPTIONS = (
    "-H",
    "--hosts",
    "-i",
    "--identity",
    "-S",
    "--ssh-config",
    "-t",
    "-c",
    "-f",
    "-r",
    "--search-root",
    "--collection",
    "--config",
)


def _python_messages(path: Path) -> list[str]:
    """String literals; an f-string's replacement fields read as `{}`."""
    texts = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.JoinedStr):
            texts.append(
                "".join(
                    part.value if isinstance(part, ast.Constant) else "{}" for part in node.values
                )
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
    return texts


def _messages() -> list[tuple[str, str]]:
    found = [
        (str(path.relative_to(REPO)), text)
        for pattern in PYTHON_SOURCES
        for path in sorted(REPO.glob(pattern))
        for text in _python_messages(path)
    ]
    found += [
        (str(path.relative_to(REPO)), path.read_text(encoding="utf-8"))
        for pattern in TEXT_SOURCES
        for path in sorted(REPO.glob(pattern))
        if ".venv" not in path.parts
    ]
    return found


def remedies(text: str) -> list[list[str]]:
    """The commands a message tells its reader to run, as words (`&&`, `;` and `/` split them)."""
    commands = []
    for span in _SPAN.finditer(text):
        for part in re.split(r"&&|;|\|\|| / ", span.group(1)):
            for command in _COMMAND.finditer(part.strip()):
                commands.append(command.group(1).replace("python3 -m", "python -m").split())
    return commands


@cache
def make_targets(directory: str) -> frozenset[str]:
    """The targets make knows in `directory` (its Makefile and every included file)."""
    database = subprocess.run(
        ["make", "--no-print-directory", "-pRrq", "-C", str(REPO / directory)],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    targets = set()
    for line in database.splitlines():
        match = re.match(r"^([^\s#:=][^:=]*):(?!=)", line)
        if match:
            targets.update(match.group(1).split())
    return frozenset(targets)


@cache
def fab_tasks() -> frozenset[str]:
    spec = importlib.util.spec_from_file_location("fabfile", REPO / "fabfile.py")
    fabfile = sys.modules["fabfile"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fabfile)
    return frozenset(fabfile.ns.task_names)


# DVC's own parser, in a process of its own (building it reads that process's command line).
_DVC_COMMANDS = """
import argparse, json
from dvc.cli.parser import get_main_parser

def choices(parser):
    return next((action.choices for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)), {})

print(json.dumps({name: sorted(choices(sub)) for name, sub in choices(get_main_parser()).items()}))
"""


@cache
def dvc_commands() -> dict[str, frozenset[str]]:
    """DVC's commands (aliases too) -> their subcommands (empty for a command without any)."""
    result = subprocess.run(
        [sys.executable, "-c", _DVC_COMMANDS],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return {name: frozenset(subs) for name, subs in json.loads(result.stdout).items()}


def _operands(words: list[str], value_options: tuple[str, ...]) -> list[str]:
    """The words after the program that are neither options (nor their values) nor VAR=VALUE."""
    operands, skip = [], False
    for word in words[1:]:
        if skip:
            skip = False
        elif word in value_options:
            skip = True
        elif not word.startswith("-") and "=" not in word:
            operands.append(word.rstrip(":,."))
    return operands


def problem(words: list[str]) -> str | None:
    """Why the command does not exist; None when it does (or names a placeholder, not a thing)."""
    program = words[0]
    if program == "make":
        operands = _operands(words, MAKE_VALUE_OPTIONS)
        directory = words[words.index("-C") + 1] if "-C" in words else "."
        if operands and not _placeholder(operands[0]) and not _is_target(operands[0], directory):
            return f"no make target {operands[0]!r} in {directory}/"
    elif program == "fab":
        operands = _operands(words, FAB_VALUE_OPTIONS)
        if operands and not _placeholder(operands[0]) and operands[0] not in fab_tasks():
            return f"no fab task {operands[0]!r} in fabfile.py"
    elif program == "dvc":
        operands = _operands(words, ())
        commands = dvc_commands()
        if operands and operands[0] not in commands:
            return f"no dvc command {operands[0]!r}"
        if (
            operands
            and commands[operands[0]]
            and len(operands) > 1
            and operands[1] not in commands[operands[0]]
        ):
            return f"no dvc {operands[0]} subcommand {operands[1]!r}"
    elif words[:2] == ["python", "-m"] and len(words) > 2 and words[2].startswith("clipforge"):
        module = words[2]
        if not _placeholder(module) and not _module_exists(module):
            return f"no module {module}"
    return None


def _module_exists(module: str) -> bool:
    """A clipforge module, or one of infra's (clipforge_infra, run from infra/ as its remedies
    say; not importable from the repository root)."""
    if module.startswith("clipforge_infra"):
        path = REPO / "infra" / Path(*module.split("."))
        return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()
    return importlib.util.find_spec(module) is not None


def _is_target(name: str, directory: str) -> bool:
    targets = make_targets(directory)
    # `make up/down/preview`: shorthand for three targets
    return name in targets or all(part in targets for part in name.split("/"))


def _placeholder(word: str) -> bool:
    return any(mark in word for mark in "<{[")


def test_every_remedy_names_a_command_that_exists():
    """Each make target, fab task, dvc command and clipforge module named in a message exists."""
    found = [(where, words) for where, text in _messages() for words in remedies(text)]
    assert len(found) > 50  # the scan reads what it should: the project names many remedies
    wrong = sorted(
        {
            f"{where}: `{shlex.join(words)}`: {why}"
            for where, words in found
            if (why := problem(words))
        }
    )
    assert wrong == []


@pytest.mark.parametrize(
    "message, why",
    [
        ("push it (make -C docker push)", "no make target 'push' in docker/"),
        ("run `make image-pull REGISTRY=x`", "no make target 'image-pull' in ./"),
        ("`fab -H me@host:22 -i key restart`", "no fab task 'restart' in fabfile.py"),
        ("run `dvc repro data && dvc pushh`", "no dvc command 'pushh'"),
        ("`dvc exp rerun`", "no dvc exp subcommand 'rerun'"),
        ("'python -m clipforge.trainer'", "no module clipforge.trainer"),
    ],
)
def test_a_remedy_that_points_to_nothing_is_caught(message, why):
    """The check finds the command in a message and says what does not exist."""
    assert [problem(words) for words in remedies(message)][-1] == why


@pytest.mark.parametrize(
    "message",
    [
        "run `make image-push REGISTRY=ghcr.io/org`",
        "(`fab -H a,b status --run r1`)",
        "`dvc remote add -d store s3://b`",
        '"python -m clipforge.launcher.host.supervisor stop"',
        "`fab --list`",
        "(make -C infra)",
        "(so that make, the shell and Python agree)",
    ],
)
def test_a_remedy_that_exists_passes(message):
    """Commands that exist, and prose or bare program names, raise nothing."""
    assert all(problem(words) is None for words in remedies(message))
