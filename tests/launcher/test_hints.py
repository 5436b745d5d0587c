"""What the tasks print for the next step (the user's own connection flags, the right refs), and
for a flag in the wrong place."""

from __future__ import annotations

import re
import sys

import pytest

from clipforge.errors import LauncherError
from clipforge.launcher.session import fab_command, refuse_identity_after_task
from clipforge.launcher.ssh_hosts import watch_lines
from clipforge.repro.experiments import experiment_baselines, newest_experiment
from tests.conftest import REPO
from tests.support.repro_runs import fab


def test_hints_repeat_the_hosts_and_key_the_user_typed():
    """`fab -H me@box -i KEY train ...` -> the hints say `fab -H me@box -i KEY status`: a bare
    `fab status` would look for the stack's workers."""
    argv = ["/venv/bin/fab", "-H", "me@127.0.0.1:2222", "-i", "/keys/my key", "train", "--smoke"]
    assert fab_command(argv) == "fab -H me@127.0.0.1:2222 -i '/keys/my key'"
    assert fab_command(["fab", "--hosts=a,b", "--identity=/k", "status"]) == (
        "fab --hosts=a,b --identity=/k"
    )
    assert fab_command(["fab", "train", "--gpus", "4"]) == "fab"


def test_fab_train_says_how_to_watch_the_run_one_command_a_line():
    """No ` | ` between commands (it read as a shell pipe), each line within 80 columns with the
    README's -H and -i, and each command whole from `fab` on."""
    argv = ["fab", "-H", "me@gpu-box", "-i", "/home/me/.ssh/id_ed25519", "train", "--gpus", "4"]
    fab_flags = fab_command(argv)
    lines = watch_lines(fab_flags)
    assert max(map(len, lines)) <= 80 and not any(" | " in line for line in lines)
    commands = [line.partition(fab_flags)[2] for line in lines]
    assert commands == [" status --watch", " logs --follow", " tensorboard", " stop"]


def test_the_newest_experiment_skips_dvcs_bookkeeping_refs():
    baseline = "refs/exps/ab/" + "cd" * 19
    refs = f"refs/exps/exec/EXEC_BASELINE\n{baseline}/juicy-yarn\n{baseline}/old\n"
    assert newest_experiment(refs) == f"{baseline}/juicy-yarn"
    assert newest_experiment("refs/exps/celery/x\n") is None and newest_experiment("") is None


def test_the_commits_with_experiments_are_each_named_once():
    """What `fab runs` passes to `dvc exp show --rev`: DVC's refs split the commit 2/38."""
    first, second = "ab" + "cd" * 19, "12" + "34" * 19
    refs = f"refs/exps/exec/EXEC_BASELINE\nrefs/exps/ab/{'cd' * 19}/juicy-yarn\n"
    refs += f"refs/exps/12/{'34' * 19}/demo\nrefs/exps/ab/{'cd' * 19}/old\n"
    assert experiment_baselines(refs) == [first, second]
    assert experiment_baselines("") == []


def test_a_ref_that_is_no_dvc_experiment_is_never_fetched():
    """The host lists the refs that `fab fetch` writes into the local repository: one that is not
    DVC's experiment form (a branch, a refspec with `:`, a `..`) is no experiment."""
    baseline = "refs/exps/ab/" + "cd" * 19
    for ref in ("refs/heads/main", f"{baseline}/x:refs/heads/main", f"{baseline}/../../heads/main",
                "refs/exps/../heads/main", f"{baseline}/-rf"):  # fmt: skip
        assert newest_experiment(ref + "\n") is None, ref


def test_an_identity_flag_after_the_task_is_refused_saying_where_the_key_goes():
    """After the task, -i is the task's --image: `fab -H h train ... -i KEY` stops at once, in
    one line that shows the key before the task, and never tries SSH without a key."""
    refused = fab("-H", "nobody@127.0.0.1:9", "train", "--gpus", "0", "--smoke", "-i", "/k/id")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        "fab train: error: -i after the task is --image; the SSH key goes before the task: "
        "fab -H HOST -i KEY train ..."
    ]
    for late in (["-i=/k"], ["-i/k"], ["--gpus", "0", "-i", "/k"]):
        with pytest.raises(LauncherError, match="goes before the task"):
            refuse_identity_after_task(["fab", "-H", "check", "-i", "/k", "check", *late], "check")
    refuse_identity_after_task(["fab", "-H", "h", "-i", "/k", "train", "--image", "x"], "train")


def test_no_option_has_a_dash_or_a_second_meaning_of_i_for_its_short_flag():
    """`fab --help train` lists --min-gpus on its own (Invoke had given it the short flag `-`,
    shown as `--=STRING`); no task's option but --image has -i, Fabric's flag for the key."""
    shown = fab("--help", "train")
    assert shown.returncode == 0, shown.stderr
    assert "  --min-gpus=STRING " in shown.stdout and "--=" not in shown.stdout
    sys.path.insert(0, str(REPO))
    try:
        import fabfile
    finally:
        sys.path.remove(str(REPO))
    short = {
        (task, name): arg.name
        for task in fabfile.ns.task_names
        for arg in fabfile.ns.tasks[task].get_arguments()
        for name in arg.names
        if len(name) == 1
    }
    assert "-" not in {name for _, name in short}
    assert {task: option for (task, name), option in short.items() if name == "i"} == {
        "check": "image",
        "train": "image",
    }


def test_fab_list_gives_each_task_a_whole_sentence_at_80_columns(monkeypatch):
    """`fab --list` shows each task's first docstring line: a whole sentence (ending in a full
    stop), not one cut after a comma or mid-phrase; within 80 columns, wrapped where longer."""
    monkeypatch.setenv("COLUMNS", "80")
    listed = fab("--list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    described: dict[str, str] = {}
    for line in lines[lines.index("Available tasks:") + 1 :]:
        if re.match(r"  \S", line):  # a task; a deeper indent continues its description
            name, _, text = line.strip().partition(" ")
            described[name] = text.strip()
        elif line.strip():
            described[name] += " " + line.strip()
    assert {"train", "status", "fetch", "clean", "rerun"} <= set(described)
    assert all(text.endswith(".") for text in described.values()), described
