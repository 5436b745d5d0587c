"""Every command in the code blocks of README.md and docs/ is one the project has: a `make`
target, a `fab` task with its options, a stage's flags, a `dvc` command DVC's own parser takes.
And each command of a code block (what a reader copies into a shell) runs somewhere: in a named
test (RUN_BY), in CI itself (.ci/run), or its line is marked as needing what no test machine has
(`[needs: GPU host]` at the end of its comment: NEEDS).

A renamed target, task or flag then fails here, not in a newcomer's shell, and so does a new
documented command that nothing runs.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from functools import cache

import pytest

from tests.conftest import REPO
from tests.test_makefile import MAKE, phony_targets

DOCUMENTS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
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


# -- every command of a code block runs somewhere -------------------------------------------------
# What a command needs that no test machine has, at the end of its line's comment:
# `fab -H me@gpu-box ... train --gpus 4  # the real run [needs: GPU host]`. Only what is missing
# here: a command that runs on this machine's CPU, sshd or S3 stand-in is run by a test instead.
NEEDS = re.compile(r"\[needs: (?P<what>[^\]]+)\]\s*$")
REQUIREMENTS = {
    "GPU host": "GPUs (and root on their hosts): here, --gpus 0 on 127.0.0.1's sshd stands in",
    "Kubernetes": "a cluster of `make up`'s stack, its workers and their volumes",
    "internet": "a download (weights, a dataset) from the network, which test machines lack",
}
CI_SCRIPT = REPO / ".ci" / "run"
# Each documented command (its words as the shell splits them) -> the test that runs it: through
# its CLI in a subprocess, or its module's main(argv) in-process; a fab task against a real
# sshd on 127.0.0.1 in place of the doc's host, placeholders (ID, runs/ID_A) filled in.
RUN_BY = {
    "make demo": "tests/test_clean_clone.py::test_demo_shows_the_experiment_with_its_recall_on_screen",
    "source .venv/bin/activate": "tests/test_clean_clone.py::test_the_readmes_commands_after_the_demo_run_in_its_shell",
    "dvc metrics show": "tests/test_clean_clone.py::test_the_readmes_commands_after_the_demo_run_in_its_shell",
    "dvc plots show": "tests/test_clean_clone.py::test_the_readmes_commands_after_the_demo_run_in_its_shell",
    "tensorboard --logdir logs": "tests/test_clean_clone.py::test_tensorboard_serves_the_demos_run_from_logs",
    "fab -H me@gpu-box -i ~/.ssh/id_ed25519 status": "tests/launcher/test_journey.py::test_the_run_evaluates_and_status_shows_the_recall",
    "fab -H me@gpu-box -i ~/.ssh/id_ed25519 fetch": "tests/launcher/test_smoke_run.py::test_fetch_brings_metrics_model_and_logs_home",
    "fab -H me@gpu-box.example.org -i ~/.ssh/id_ed25519 fetch": "tests/launcher/test_smoke_run.py::test_fetch_brings_metrics_model_and_logs_home",
    "fab -H me@gpu-box.example.org -i ~/.ssh/id_ed25519 status --price-per-gpu-hour 1.85": "tests/launcher/test_quick_start.py::test_own_box_status_logs_and_fetch",
    "fab -H me@gpu-box.example.org -i ~/.ssh/id_ed25519 logs --follow": "tests/launcher/test_quick_start.py::test_own_box_status_logs_and_fetch",
    "fab runs": "tests/repro/test_runs.py::test_fab_runs_lists_fetched_runs_best_first_within_80_columns",
    "fab runs --sort-by test.mean_recall": "tests/repro/test_runs.py::test_fab_runs_lists_fetched_runs_best_first_within_80_columns",
    "fab runs --params": "tests/repro/test_runs.py::test_fab_runs_lists_fetched_runs_best_first_within_80_columns",
    "dvc exp show --drop .* --keep Experiment|val_loss|mean_over_suites --sort-by mean_over_suites --sort-order desc": "tests/pipeline/test_dvc_pipeline.py::test_the_documented_comparisons_fit_80_columns_and_sort_best_first",
    "dvc exp show --drop .* --keep Experiment|.*mean_recall$": "tests/pipeline/test_dvc_pipeline.py::test_the_documented_comparisons_fit_80_columns_and_sort_best_first",
    "dvc exp show --drop .* --keep Experiment|.*top1$": "tests/pipeline/test_dvc_pipeline.py::test_the_documented_comparisons_fit_80_columns_and_sort_best_first",
    "dvc exp show --param-deps --only-changed --drop [^:]*$|resolved/ --keep Experiment|mean_over_suites": "tests/pipeline/test_dvc_pipeline.py::test_the_documented_comparisons_fit_80_columns_and_sort_best_first",
    "dvc exp run -S train.lr=5e-4": "tests/pipeline/test_dvc_pipeline.py::test_exp_run_with_a_changed_param_reruns_train_and_eval_only",
    "fab rerun ID": "tests/launcher/test_rerun.py::test_a_fetched_smoke_run_rerun_on_the_host_is_identical_to_it",
    "fab -H user@box rerun runs/ID": "tests/launcher/test_rerun.py::test_a_fetched_smoke_run_rerun_on_the_host_is_identical_to_it",
    "fab rerun ID --allow-stack-change": "tests/launcher/test_rerun.py::test_a_fetched_smoke_run_rerun_on_the_host_is_identical_to_it",
    "fab fetch --launch NEW": "tests/launcher/test_rerun.py::test_a_fetched_smoke_run_rerun_on_the_host_is_identical_to_it",
    "fab compare ID NEW": "tests/launcher/test_rerun.py::test_a_fetched_smoke_run_rerun_on_the_host_is_identical_to_it",
    "fab compare runs/ID_A runs/ID_B": "tests/repro/test_compare.py::test_fab_compare_exits_0_on_identical_and_1_on_different",
    "fab compare runs/ID_A runs/ID_B --tolerance 0.5": "tests/repro/test_compare.py::test_a_stated_tolerance_accepts_small_metric_differences",
    "fab publish runs/ID --to s3://bucket/models/name": "tests/repro/test_publish.py::test_publish_to_s3_and_pull_back",
    "fab pull s3://bucket/models/name --to models/name": "tests/repro/test_publish.py::test_publish_to_s3_and_pull_back",
    "python -m clipforge.pipeline.recipe production": "tests/pipeline/test_dvc_pipeline.py::test_a_recipe_written_into_params_yaml_is_what_the_experiment_shows",
    "python -m clipforge.pipeline.recipe default": "tests/test_config.py::test_the_production_recipe_written_into_params_yaml_is_what_runs",
    "python -m clipforge.pipeline.recipe lit-zh": "tests/test_config.py::test_an_open_weights_recipe_written_into_params_yaml_is_what_runs",
    "python -m clipforge.pipeline.recipe distill-b32-from-b16": "tests/test_config.py::test_an_open_weights_recipe_written_into_params_yaml_is_what_runs",
    "python -m clipforge.pipeline.recipe finetune-zh": "tests/test_config.py::test_an_open_weights_recipe_written_into_params_yaml_is_what_runs",
    "git commit -qam production recipe": "tests/launcher/test_quick_start.py::test_gpus_4_on_own_box_stops_only_at_the_gpu_row",
    "python -m clipforge.data": "tests/pipeline/test_dvc_pipeline.py::test_repro_runs_data_train_eval_and_writes_the_documented_layout",
    "python -m clipforge.train": "tests/pipeline/test_dvc_pipeline.py::test_repro_runs_data_train_eval_and_writes_the_documented_layout",
    "python -m clipforge.eval": "tests/pipeline/test_dvc_pipeline.py::test_repro_runs_data_train_eval_and_writes_the_documented_layout",
    "dvc repro": "tests/pipeline/test_dvc_pipeline.py::test_second_repro_runs_nothing",
    "dvc exp apply NAME": "tests/launcher/test_journey.py::test_the_demo_is_an_experiment_whose_apply_leaves_nothing_to_reproduce",
    "dvc params diff": "tests/pipeline/test_dvc_pipeline.py::test_a_recipe_written_into_params_yaml_is_what_the_experiment_shows",
    "python -m clipforge.eval --model local-dir:models/clip --out metrics/eval.json": "tests/eval/test_stage.py::test_the_documented_line_evaluates_the_export_in_models_clip",
}


def code_block_commands(document: str) -> list[tuple[int, list[str], str | None]]:
    """Each command of the document's sh code blocks: its line number, its words (a `&&` chain
    split), and what its line's comment says it needs (None: nothing this machine lacks)."""
    text = (REPO / document).read_text(encoding="utf-8")
    found = []
    for block in re.finditer(r"^```(?:sh|bash)\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        first = text[: block.start(1)].count("\n") + 1
        for offset, line in _logical_lines(block.group(1)):
            needs = NEEDS.search(line)
            for argv in _split_chain(line):
                found.append((first + offset, argv, needs["what"] if needs else None))
    return found


def _logical_lines(block: str) -> list[tuple[int, str]]:
    """The block's lines with `\\` continuations joined, each with the offset of its first."""
    lines, start, current = [], 0, ""
    for number, line in enumerate(block.splitlines()):
        if not current:
            start = number
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append((start, current + line))
        current = ""
    return lines


def _block_commands() -> list[tuple[str, str, str | None]]:
    return [
        (f"{doc}:{line}", " ".join(argv), needs)
        for doc in DOCUMENTS
        for line, argv, needs in code_block_commands(doc)
    ]


def _ci_runs(command: str) -> bool:
    """`make TARGET...` whose every target a `make` line of .ci/run runs."""
    words = command.split()
    if words[0] != "make":
        return False
    ci_make_words = {
        word
        for line in CI_SCRIPT.read_text().splitlines()
        if re.search(r"(^|\s|\()make ", line)
        for word in shlex.split(line.split("make ", 1)[1], comments=True)
    }
    return all(word in ci_make_words for word in words[1:])


@pytest.mark.parametrize(
    "where,command,needs", _block_commands(), ids=[w for w, *_ in _block_commands()]
)
def test_each_documented_command_runs_in_a_test_in_ci_or_is_marked_as_needing_hardware(
    where, command, needs
):
    if needs is not None:
        assert needs in REQUIREMENTS, f"{where}: [needs: {needs}]: one of {sorted(REQUIREMENTS)}"
        assert command not in RUN_BY, (
            f"{where}: `{command}` is marked [needs: {needs}] but {RUN_BY[command]} runs it"
        )
        return
    assert command in RUN_BY or _ci_runs(command), (
        f"{where}: `{command}` is run by no test: add the test that runs it to RUN_BY, or mark "
        f"its line `# ... [needs: X]` (X: {', '.join(REQUIREMENTS)}) if it cannot run here"
    )


@cache
def _test_functions(path: str) -> tuple[dict[str, str], str]:
    """The module's functions' sources, by name, and the module's source."""
    source = (REPO / path).read_text(encoding="utf-8")
    functions = {
        node.name: ast.get_source_segment(source, node) or ""
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef)
    }
    return functions, source


@pytest.mark.parametrize("command,test", sorted(RUN_BY.items()), ids=sorted(RUN_BY))
def test_the_test_that_runs_a_documented_command_exists_and_gives_its_options(command, test):
    """RUN_BY names a test function that is there, whose module spells each of the command's
    long options (the fixture that runs the command may be the module's)."""
    path, name = test.split("::")
    functions, source = _test_functions(path)
    assert name in functions, f"{command}: no test {test}"
    if any(doc in functions[name] for doc in DOCUMENTS):
        return  # it reads the command from the document and runs it as written
    for word in command.split():
        if word.startswith("--"):
            assert word.split("=")[0] in source, f"{command}: {path} never gives {word}"


def test_every_command_run_by_is_documented():
    """No stale RUN_BY row: each is a command of a code block."""
    documented = {command for _, command, _ in _block_commands()}
    assert set(RUN_BY) <= documented, sorted(set(RUN_BY) - documented)
