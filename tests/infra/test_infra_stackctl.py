"""Pieces of `make up` that need no CLI: kubeconfig resolution, outputs file. (The image
reference, from docker/image.env, is tested with its reader in tests/test_image_env.py.)"""

from __future__ import annotations

import os

import pytest
import yaml
from infra_harness import REPO  # noqa: F401  (puts infra/ on sys.path)

from clipforge_infra.kubeconfig import KubeconfigError, resolve_context
from clipforge_infra.stackctl import access_lines, write_outputs


def write_kubeconfig(path, contexts, current=""):
    path.write_text(
        yaml.safe_dump({"current-context": current, "contexts": [{"name": c} for c in contexts]})
    )
    return path


def test_empty_kube_context_means_the_current_context(tmp_path):
    """kubeContext "" resolves to the kubeconfig's current-context."""
    config = write_kubeconfig(tmp_path / "config", ["a", "b"], current="b")
    assert resolve_context("", {"KUBECONFIG": str(config)}) == "b"


def test_kubeconfig_list_is_merged_like_kubectl(tmp_path):
    """Contexts from every file in $KUBECONFIG count; the first file's current-context wins."""
    first = write_kubeconfig(tmp_path / "one", ["a"], current="a")
    second = write_kubeconfig(tmp_path / "two", ["gpu"], current="gpu")
    environ = {"KUBECONFIG": f"{first}{os.pathsep}{second}"}
    assert resolve_context("gpu", environ) == "gpu"
    assert resolve_context("", environ) == "a"


def test_no_current_context_and_no_kube_context_is_an_error(tmp_path):
    """Without either, the error tells how to set kubeContext."""
    config = write_kubeconfig(tmp_path / "config", ["a"])
    with pytest.raises(KubeconfigError, match="config set kubeContext"):
        resolve_context("", {"KUBECONFIG": str(config)})


def test_default_kubeconfig_is_under_home(tmp_path):
    """Without $KUBECONFIG, ~/.kube/config is read."""
    (tmp_path / ".kube").mkdir()
    write_kubeconfig(tmp_path / ".kube" / "config", ["home-ctx"], current="home-ctx")
    assert resolve_context("", {"HOME": str(tmp_path)}) == "home-ctx"


def test_a_kubeconfig_that_does_not_parse_is_one_line_naming_it(tmp_path):
    config = tmp_path / "config"
    config.write_text("contexts:\n- name: a\n  - name: b\n")
    with pytest.raises(KubeconfigError) as raised:
        resolve_context("", {"KUBECONFIG": str(config)})
    assert str(raised.value) == (
        f"{config}:3:3: expected <block end>, but found '-' (while parsing a block mapping on "
        f"line 2)"
    )
    config.write_text("- not a mapping\n")
    with pytest.raises(KubeconfigError, match="not a kubeconfig"):
        resolve_context("", {"KUBECONFIG": str(config)})


def test_outputs_file_is_replaced_whole_or_not_at_all(tmp_path):
    """Unparseable CLI output leaves the previous outputs file as it was, with no temp file behind."""
    path = tmp_path / "stack-outputs.json"
    write_outputs('{"namespace": "clipforge"}', path, "gpu")
    with pytest.raises(ValueError):
        write_outputs('{"namespace": ', path, "gpu")
    assert yaml.safe_load(path.read_text()) == {"namespace": "clipforge", "kube_context": "gpu"}
    assert [p.name for p in tmp_path.iterdir()] == ["stack-outputs.json"]


def test_make_up_on_a_jobs_stack_prints_tensorboard_and_no_ssh_line():
    """runMode jobs: no worker to port-forward to; TensorBoard as on any stack."""
    outputs = {
        "kube_context": "gpu-cluster",
        "namespace": "clipforge",
        "run_mode": "jobs",
        "workers": [],
        "tensorboard": {"service": "clipforge-tensorboard", "port": 6006},
    }
    lines = access_lines(outputs)
    assert lines[0].startswith("runs: no SSH workers (runMode jobs)")
    assert "port-forward svc/clipforge-tensorboard 6006:6006" in lines[1]
    assert not any(line.startswith("ssh:") for line in lines)
