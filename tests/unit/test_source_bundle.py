"""The code a moved run ships: the commit of its launch, which need not be the local HEAD any more
(clipforge.launcher.source, with real git)."""

from __future__ import annotations

import pytest

from clipforge.launcher import LauncherError
from clipforge.launcher.source import source_at, write_bundle
from tests.conftest import git


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
