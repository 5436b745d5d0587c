"""`fab check` against a real sshd on this machine (a host without GPUs)."""

from __future__ import annotations


def test_check_passes_for_a_cpu_run(fab, sshd):
    """With --gpus 0 every row of a CPU host passes: ssh, disk, storage, git, the python stack."""
    result = fab(
        "check", "--gpus", "0", "--runtime", "host", hosts=sshd.address, key=sshd.client_key
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _rows(result.stdout)
    assert rows["ssh"] == "ok" and rows["gpus"] == "skip"
    assert rows["storage"] == "ok" and rows["disk"] == "ok" and rows["python env"] == "ok"


def test_check_fails_the_gpu_row_on_a_host_without_gpus(fab, sshd):
    """Asking for GPUs on a host that has none fails the gpus row and the command."""
    result = fab(
        "check", "--gpus", "4", "--runtime", "host", hosts=sshd.address, key=sshd.client_key
    )
    assert result.returncode != 0
    assert _rows(result.stdout)["gpus"] == "FAIL"
    assert "--gpus 4 asked, no GPU visible" in result.stdout


def test_check_without_gpus_option_expects_a_gpu(fab, sshd):
    """Plain `fab check` checks a GPU host: no GPU is a failure, not a pass."""
    result = fab("check", "--runtime", "host", hosts=sshd.address, key=sshd.client_key)
    assert result.returncode != 0 and _rows(result.stdout)["gpus"] == "FAIL"


def test_docker_runtime_without_docker_fails_its_row(fab, sshd):
    """The docker runtime needs a Docker engine; this host has none, so the docker row fails."""
    result = fab(
        "check", "--gpus", "0", "--runtime", "docker", hosts=sshd.address, key=sshd.client_key
    )
    assert result.returncode != 0
    rows = _rows(result.stdout)
    assert rows["docker"] == "FAIL" and rows["image"] == "FAIL"


def test_check_rejects_a_data_path_without_a_manifest(fab, sshd, tmp_path):
    """--data PATH must hold a data stage output (its manifest.json)."""
    result = fab(
        "check",
        "--gpus",
        "0",
        "--runtime",
        "host",
        "--data",
        str(tmp_path),
        hosts=sshd.address,
        key=sshd.client_key,
    )
    assert result.returncode != 0 and _rows(result.stdout)["data"] == "FAIL"


def _rows(output: str) -> dict[str, str]:
    """name -> status of the preflight table."""
    rows = {}
    for line in output.splitlines():
        if line.startswith("  "):
            parts = line.split()
            for status in ("ok", "FAIL", "skip"):
                if status in parts:
                    name = " ".join(parts[: parts.index(status)])
                    rows[name] = status
                    break
    return rows


def test_nodes_with_different_images_or_stacks_are_named():
    """The nodes of a run must agree on the image's ID (docker) or the stack's versions (host):
    a difference names each node's; agreement, or a pullable image with no ID yet, passes."""
    from clipforge.launcher.preflight import OK, Row, stack_mismatch

    def image(detail: str) -> list[Row]:
        return [Row("ssh", OK, "Linux"), Row("image", OK, detail)]

    labels = ["a:22", "b:22"]
    same = image("clipforge:t present (sha256:1111)")
    assert stack_mismatch(labels, [same, same]) is None
    assert stack_mismatch(labels, [image("clipforge:t pullable")] * 2) is None
    found = stack_mismatch(labels, [same, image("clipforge:t present (sha256:2222)")])
    assert (
        "the nodes do not run the same image" in found
        and "b:22: clipforge:t present (sha256:2222)" in found
    )
    host_a = [Row("python env", OK, "python 3.11, torch 2.1.2")]
    host_b = [Row("python env", OK, "python 3.11, torch 2.14.1")]
    assert "same python env" in stack_mismatch(labels, [host_a, host_b])
