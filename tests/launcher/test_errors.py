"""Bad hosts, keys and launches: a clear error, a non-zero exit, nothing left running."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import REPO, git
from tests.launcher.conftest import SMALL_SETS, host_train_args, make_fab, set_args
from tests.support.hostprocs import processes_under
from tests.support.sshd import FabRunner, free_port, keygen


def _train(fab, sshd, *args, **kwargs):
    return fab(
        *host_train_args(),
        *set_args(SMALL_SETS),
        *args,
        hosts=kwargs.pop("hosts", sshd.address),
        key=kwargs.pop("key", sshd.client_key),
        **kwargs,
    )


def _nothing_started(remote_root) -> bool:
    return not (remote_root / "runs").exists() and processes_under(remote_root.parent) == []


def test_unreachable_host(fab, sshd, remote_root):
    """A port where no sshd listens: the error names the host and the refused connection."""
    result = _train(fab, sshd, hosts=f"{sshd.user}@127.0.0.1:{free_port()}")
    assert result.returncode != 0
    assert "cannot connect" in result.stderr and "Connection refused" in result.stderr
    assert _nothing_started(remote_root)


def test_wrong_key(fab, sshd, remote_root, tmp_path):
    """A key the host does not authorize: authentication fails, with what to do."""
    stranger = keygen(tmp_path / "stranger")
    result = _train(fab, sshd, key=stranger)
    assert result.returncode != 0
    assert "SSH authentication failed" in result.stderr and "-i" in result.stderr
    assert _nothing_started(remote_root)


def test_unknown_host_key_is_refused(project, sshd, tmp_path):
    """A host whose key is not in known_hosts is refused (Fabric alone would accept it), with its
    fingerprint and how to add it; known_hosts stays untouched."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text("")
    fab = make_fab(project, home, tmp_path / "remote", sshd)
    result = fab(
        "check", "--gpus", "0", "--runtime", "host", hosts=sshd.address, key=sshd.client_key
    )
    assert result.returncode != 0
    assert "host key not known" in result.stdout + result.stderr
    assert "SHA256:" in result.stdout + result.stderr and "--accept-new-host-key" in result.stdout
    assert (home / ".ssh" / "known_hosts").read_text() == ""


def test_accept_new_host_key_records_it(project, sshd, tmp_path):
    """--accept-new-host-key (the opt-out for fresh hosts) records the key; later connections then
    verify against it without the flag."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text("")
    fab = make_fab(project, home, tmp_path / "remote", sshd)
    first = fab(
        "check",
        "--gpus",
        "0",
        "--runtime",
        "host",
        "--accept-new-host-key",
        hosts=sshd.address,
        key=sshd.client_key,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert sshd.host_public_key.split()[1] in (home / ".ssh" / "known_hosts").read_text()
    again = fab(
        "check", "--gpus", "0", "--runtime", "host", hosts=sshd.address, key=sshd.client_key
    )
    assert again.returncode == 0


def test_changed_host_key_is_refused_even_with_accept_new(project, sshd, tmp_path):
    """A known host presenting another key is refused, --accept-new-host-key or not."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    keygen(tmp_path / "other_host_key")
    kind, blob = (tmp_path / "other_host_key.pub").read_text().split()[:2]
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {kind} {blob}\n")
    fab = make_fab(project, home, tmp_path / "remote", sshd)
    result = fab(
        "check", "--gpus", "0", "--accept-new-host-key", hosts=sshd.address, key=sshd.client_key
    )
    assert result.returncode != 0 and "host key CHANGED" in result.stdout


def test_dirty_tree_is_refused(project, sshd, tmp_path):
    """Uncommitted changes: refused before connecting, naming the changed file and --allow-dirty."""
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "--quiet", str(project), str(clone))
    with open(clone / "params.yaml", "a") as f:
        f.write("\n# an uncommitted edit\n")
    fab = make_fab(clone, tmp_path / "home", tmp_path / "remote", sshd)
    result = _train(fab, sshd)
    assert result.returncode != 0
    assert "not committed" in result.stderr and "params.yaml" in result.stderr
    assert "--allow-dirty" in result.stderr
    assert not (tmp_path / "remote").exists()


def test_bad_override_fails_before_connecting(fab, sshd, remote_root):
    """A --set the stages would reject is rejected on the laptop, naming the key."""
    result = _train(fab, sshd, "--set", "train.lr=-1")
    assert result.returncode != 0 and "train.lr" in result.stderr
    assert not remote_root.exists()


def test_launch_keys_come_from_gpus_and_nodes(fab, sshd, remote_root):
    """--set train.ranks_per_node conflicts with --gpus: refused, pointing at --gpus."""
    result = _train(fab, sshd, "--set", "train.ranks_per_node=2")
    assert result.returncode != 0 and "--gpus" in result.stderr


def test_nodes_must_match_hosts(fab, sshd, remote_root):
    """--nodes 2 with one -H host: refused before connecting."""
    result = _train(fab, sshd, "--nodes", "2")
    assert result.returncode != 0 and "needs exactly 2 host(s)" in result.stderr


def test_no_host_at_all(fab, sshd):
    """No -H and no stack outputs file: says how to give hosts."""
    result = fab("status")
    assert result.returncode != 0
    assert "no hosts" in result.stderr and "-H" in result.stderr and "make up" in result.stderr


def test_data_pull_needs_a_dvc_remote(fab, sshd, remote_root):
    """--data pull without a DVC remote/lock in the commit: refused with the alternatives."""
    result = fab(*host_train_args("pull"), hosts=sshd.address, key=sshd.client_key)
    assert result.returncode != 0 and "--data build" in result.stderr
    assert not remote_root.exists()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (
            "clipforge:\n  min_free_gb: 5\n   python: x\n",
            ":3:10: mapping values are not allowed here",
        ),
        (
            "clipforge:\n  min_free_gbs: 5\n",
            ": clipforge.min_free_gbs is not a setting; known: backoff_seconds, "
            "backoff_max_seconds, stop_timeout_seconds, probe_every_seconds, gone_after_misses, "
            "gone_after_seconds, remote_root, python, stack_outputs, min_free_gb, shm_size, "
            "registry, socket_ifname",
        ),
        ("clipforge: 5\n", ": `clipforge` must be a mapping of settings"),
    ],
)
def test_a_broken_fabric_yaml_is_one_line_naming_it(tmp_path, content, problem):
    """Fabric reads fabric.yaml itself: a YAML mistake was its traceback, a misspelt setting
    was ignored without a word (the run then used the default)."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "fabfile.py", project)
    (project / "fabric.yaml").write_text(content)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HOME": str(tmp_path)}
    result = FabRunner(project=project, home=tmp_path, env=env)("status")
    assert result.returncode == 1
    assert result.stderr == f"fab: error: {project / 'fabric.yaml'}{problem}\n"


@pytest.mark.parametrize("flag", ["--launch", "--run"])
def test_a_launch_is_named_by_launch_or_run_its_alias(fab, tmp_path, flag):
    """`--launch ID` names a launch (its id as `fab train` printed it), and `--run ID`, the
    name users already type, is the same flag: the run store, asked for a launch it lacks,
    names it either way."""
    store = tmp_path / "store"
    store.mkdir()
    result = fab("status", flag, "20990101-000000-deadbeef", "--store", str(store))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"the run store {store} has no run 20990101-000000-deadbeef" in result.stderr


def test_two_different_launch_ids_under_both_names_are_refused(fab, tmp_path):
    result = fab("status", "--launch", "20990101-000000-a", "--run", "20990101-000000-b")
    assert result.returncode != 0
    assert "--launch 20990101-000000-a and --run 20990101-000000-b" in result.stderr
