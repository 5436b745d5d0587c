"""Every command in the code blocks of README.md and docs/ is one the project has: a `make`
target, a `fab` task with its options, a stage's flags, a `dvc` command DVC's own parser takes.

A renamed target, task or flag then fails here, not in a newcomer's shell.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.test_makefile import MAKE, phony_targets

DOCUMENTS = ("README.md", "docs/pipeline.md", "docs/launcher.md", "docs/real-data.md")
# Fabric's own flags before the task name, with a value.
FAB_CORE_WITH_VALUE = {"-H", "--hosts", "-i", "--identity", "-S", "--ssh-config"}


def documented_commands(document: str) -> list[list[str]]:
    """The command lines of the document's sh code blocks, split as the shell would, one per
    command of a `&&` or `|` chain, leading environment assignments left out; and the `make` and
    `fab` commands quoted in its text (the README's journey is a table)."""
    text = (REPO / document).read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"^```(?:sh|bash)\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            commands += _split_chain(line)
    for span in re.findall(r"`((?:make|fab) [^`]*)`", text):
        commands += _split_chain(span.replace("...", ""))
    return commands


def _split_chain(line: str) -> list[list[str]]:
    out, current = [], []
    for word in [*shlex.split(line, comments=True), "&&"]:
        if word in ("&&", "|", ";", "&"):
            while current and re.match(r"^[A-Z_]+=", current[0]):
                current.pop(0)
            if current:
                out.append(current)
            current = []
        else:
            current.append(word)
    return out


def _all_commands() -> list[tuple[str, list[str]]]:
    return [(doc, argv) for doc in DOCUMENTS for argv in documented_commands(doc)]


def _ids(pairs):
    return [f"{doc}: {' '.join(argv)[:60]}" for doc, argv in pairs]


def _of(program: str) -> list[tuple[str, list[str]]]:
    return [(doc, argv) for doc, argv in _all_commands() if argv[0] == program]


def test_the_readme_documents_the_journey():
    """The commands a newcomer walks exist in the README, in their order."""
    readme = [" ".join(argv) for argv in documented_commands("README.md")]
    assert readme[:2] == ["make demo", "make test"]
    assert any(c.startswith("fab") and " train " in f"{c} " for c in readme)


@pytest.mark.skipif(MAKE is None, reason="make is not installed")
@pytest.mark.parametrize("doc,argv", _of("make"), ids=_ids(_of("make")))
def test_make_targets_exist(doc, argv):
    targets = [w for w in argv[1:] if not w.startswith("-") and "=" not in w]
    assert set(targets) <= phony_targets(), f"{doc}: {' '.join(argv)}"


@pytest.fixture(scope="module")
def fab_tasks():
    sys.path.insert(0, str(REPO))
    try:
        import fabfile
    finally:
        sys.path.remove(str(REPO))
    return {
        name: {n for a in fabfile.ns.tasks[name].get_arguments() for n in a.names}
        for name in fabfile.ns.task_names
    }


@pytest.mark.parametrize("doc,argv", _of("fab"), ids=_ids(_of("fab")))
def test_fab_tasks_and_their_options_exist(doc, argv, fab_tasks):
    words = iter(argv[1:])
    task = None
    for word in words:
        if word in FAB_CORE_WITH_VALUE:
            next(words)
        elif not word.startswith("-"):
            task = word
            break
    if task is None and {"--list", "--help"} & set(argv):
        return  # Fabric's own listing
    assert task in fab_tasks, f"{doc}: {' '.join(argv)}: no task {task!r}"
    for word in words:
        if word.startswith("--"):
            assert word[2:].split("=")[0] in fab_tasks[task], f"{doc}: {task} has no {word}"


def _python_modules():
    return [
        (doc, argv)
        for doc, argv in _all_commands()
        if argv[0] == "python" and argv[1:2] == ["-m"] and argv[2].startswith("clipforge")
    ]


@pytest.mark.parametrize("doc,argv", _python_modules(), ids=_ids(_python_modules()))
def test_stage_flags_exist(doc, argv):
    """Each `--flag` of a `python -m clipforge.X` line is in that module's --help."""
    shown = subprocess.run(
        [sys.executable, "-m", argv[2], "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    for word in argv[3:]:
        if word.startswith("--"):
            assert word.split("=")[0] in shown.stdout, f"{doc}: {argv[2]} has no {word}"


@pytest.mark.parametrize("doc,argv", _of("dvc"), ids=_ids(_of("dvc")))
def test_dvc_commands_parse(doc, argv):
    """DVC's own parser takes each documented `dvc` command line (subcommand and options)."""
    from dvc.cli import parse_args

    parse_args(argv[1:])
