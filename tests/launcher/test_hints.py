"""What the tasks print for the next step: the user's own connection flags, the right refs."""

from __future__ import annotations

from clipforge.launcher.run_source import newest_experiment
from clipforge.launcher.session import fab_command


def test_hints_repeat_the_hosts_and_key_the_user_typed():
    """`fab -H me@box -i KEY train ...` -> the hints say `fab -H me@box -i KEY status`: a bare
    `fab status` would look for the stack's workers."""
    argv = ["/venv/bin/fab", "-H", "me@127.0.0.1:2222", "-i", "/keys/my key", "train", "--smoke"]
    assert fab_command(argv) == "fab -H me@127.0.0.1:2222 -i '/keys/my key'"
    assert fab_command(["fab", "--hosts=a,b", "--identity=/k", "status"]) == (
        "fab --hosts=a,b --identity=/k"
    )
    assert fab_command(["fab", "train", "--gpus", "4"]) == "fab"


def test_the_newest_experiment_skips_dvcs_bookkeeping_refs():
    baseline = "refs/exps/ab/" + "cd" * 19
    refs = f"refs/exps/exec/EXEC_BASELINE\n{baseline}/juicy-yarn\n{baseline}/old\n"
    assert newest_experiment(refs) == f"{baseline}/juicy-yarn"
    assert newest_experiment("refs/exps/celery/x\n") is None and newest_experiment("") is None


def test_a_ref_that_is_no_dvc_experiment_is_never_fetched():
    """The host lists the refs that `fab fetch` writes into the local repository: one that is not
    DVC's experiment form (a branch, a refspec with `:`, a `..`) is no experiment."""
    baseline = "refs/exps/ab/" + "cd" * 19
    for ref in ("refs/heads/main", f"{baseline}/x:refs/heads/main", f"{baseline}/../../heads/main",
                "refs/exps/../heads/main", f"{baseline}/-rf"):  # fmt: skip
        assert newest_experiment(ref + "\n") is None, ref
