"""The code a moved run ships: the commit of its launch, which need not be the local HEAD
(clipforge.launcher.source, with real git)."""

from __future__ import annotations

import shutil

import pytest

from clipforge.errors import LauncherError
from clipforge.launcher.source import (
    current_source,
    pipeline_outputs,
    require_clean,
    source_at,
    uncommitted,
    write_bundle,
)
from tests.conftest import REPO, git


@pytest.fixture
def repo(tmp_path):
    """A repository whose HEAD is elsewhere than the commit a run was launched at: that commit
    is on another branch, not in HEAD's history."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "--quiet", "--initial-branch=main")
    (root / "train.py").write_text("base\n")
    git(root, "add", "train.py")
    git(root, "commit", "--quiet", "-m", "base")
    git(root, "checkout", "--quiet", "-b", "experiment")
    (root / "train.py").write_text("launched\n")
    git(root, "commit", "--quiet", "-am", "the launch's commit")
    launched = git(root, "rev-parse", "HEAD").strip()
    git(root, "checkout", "--quiet", "main")
    (root / "train.py").write_text("moved on\n")
    git(root, "commit", "--quiet", "-am", "later work")
    return root, launched


def test_the_bundle_of_an_older_commit_checks_it_out_on_the_host(repo, tmp_path):
    """A host cloning the bundle can check out the launch's commit, not only HEAD."""
    root, launched = repo
    bundle = tmp_path / "code.bundle"
    write_bundle(source_at(root, launched), bundle)
    clone = tmp_path / "host-checkout"
    git(tmp_path, "clone", "--quiet", str(bundle), str(clone))
    git(clone, "-c", "advice.detachedHead=false", "checkout", "--quiet", launched)
    assert (clone / "train.py").read_text() == "launched\n"


def test_a_commit_this_clone_lacks_is_refused_saying_to_fetch_it(repo):
    root, _ = repo
    with pytest.raises(LauncherError, match="is not in this repository; `git fetch`"):
        source_at(root, "0123456789abcdef0123456789abcdef01234567")


@pytest.fixture
def pipeline_clone(tmp_path):
    """A clone-like repository: the project's dvc.yaml and a script, committed."""
    root = tmp_path / "clone"
    (root / "src").mkdir(parents=True)
    (root / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    (root / "src" / "train.py").write_text("code\n")
    git(root, "init", "--quiet", "--initial-branch=main")
    git(root, "add", ".")
    git(root, "commit", "--quiet", "-m", "base")
    return root


def test_results_of_the_pipeline_and_fabs_settings_are_never_uncommitted_changes(pipeline_clone):
    """What `dvc exp apply` leaves (dvc.lock, metrics/) and a fabric.yaml pointing at the host's
    Python do not stop `fab train`: the run rebuilds the results from the commit."""
    root = pipeline_clone
    (root / "metrics").mkdir()
    for name in ("eval.json", "eval.info.json", "train.tsv", "train.json"):
        (root / "metrics" / name).write_text("{}\n")
    (root / "dvc.lock").write_text("schema: '2.0'\n")
    (root / "fabric.yaml").write_text("clipforge:\n  python: /opt/venv/bin/python\n")
    source = current_source(root)
    assert len(source.dirty) == 6 and uncommitted(source) == []
    require_clean(source, allow_dirty=False)


def test_a_stack_file_copied_from_an_example_is_no_uncommitted_change(pipeline_clone):
    """infra/README.md's set-up (`cp infra/Pulumi.example-1x4.yaml infra/Pulumi.mine.yaml`)
    leaves a file .gitignore ignores, so `fab train` ships the commit; the examples stay tracked."""
    root, example = pipeline_clone, REPO / "infra" / "Pulumi.example-1x4.yaml"
    shutil.copy(REPO / ".gitignore", root)
    (root / "infra").mkdir()
    shutil.copy(example, root / "infra")
    git(root, "add", ".")
    git(root, "commit", "--quiet", "-m", "the project's example stack")
    assert "infra/Pulumi.example-1x4.yaml" in git(root, "ls-files", "infra")
    shutil.copy(example, root / "infra" / "Pulumi.mine.yaml")
    source = current_source(root)
    assert source.dirty == []
    require_clean(source, allow_dirty=False)


def test_code_beside_the_results_is_still_refused(pipeline_clone):
    """A new file in metrics/ that no stage writes, and an edited script, are code: refused,
    each named, the results not listed."""
    root = pipeline_clone
    (root / "metrics").mkdir()
    (root / "metrics" / "eval.json").write_text("{}\n")
    (root / "metrics" / "compare.py").write_text("print()\n")
    (root / "src" / "train.py").write_text("changed\n")
    with pytest.raises(LauncherError, match="not committed") as refused:
        require_clean(current_source(root), allow_dirty=False)
    assert "metrics/compare.py" in str(refused.value) and "src/train.py" in str(refused.value)
    assert "eval.json" not in str(refused.value)


def test_pipeline_outputs_are_read_from_dvc_yaml():
    """Every stage's outs and metrics (a foreach stage's per item) and the plotted files."""
    outputs = pipeline_outputs((REPO / "dvc.yaml").read_text())
    assert {"data", "models/clip", "metrics/eval.json", "metrics/eval.info.json"} <= set(outputs)
    assert {"resolved/train.yaml", "metrics/train.tsv", "metrics/val.tsv"} <= set(outputs)
    assert not {"checkpoints", "logs"} & set(outputs)
