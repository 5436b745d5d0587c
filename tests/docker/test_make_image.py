"""`make image` / `make image-push` refuse clearly when they cannot work; `make pin-base`. This machine has the
docker CLI but neither buildx nor an engine; a stub CLI stands in only for the engine-missing
case that cannot be produced here otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docker.conftest import REPO, load_tool


def make(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def stub_docker(tmp_path: Path, buildx_works: bool) -> Path:
    """A `docker` whose buildx answers (or not) and whose engine never does; it logs its calls."""
    log = tmp_path / "calls.log"
    script = tmp_path / "docker"
    script.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$1" in
  buildx) [ "{int(buildx_works)}" = 1 ] && echo "github.com/docker/buildx v0.17.1" && exit 0
          echo "docker: unknown command: docker buildx" >&2; exit 1 ;;
  info) echo "ERROR: Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2; exit 1 ;;
esac
exit 1
""")
    script.chmod(0o755)
    return script


def test_make_image_on_this_machine_says_what_is_missing():
    """With the machine's real docker CLI (no buildx plugin, no engine): non-zero, one line naming
    the missing piece."""
    result = make("image")
    assert result.returncode != 0
    assert "make image: error:" in result.stderr
    if shutil.which("docker") is None:
        assert "docker CLI" in result.stderr
    else:
        assert "buildx is not available" in result.stderr or "no Docker engine" in result.stderr


def test_make_image_without_docker_cli_names_it(tmp_path):
    """No docker executable at all: the message says to install Docker with buildx."""
    result = make("image", DOCKER=str(tmp_path / "no-docker-here"))
    assert result.returncode != 0
    assert "docker CLI" in result.stderr and "is not installed" in result.stderr


def test_make_image_without_buildx_names_the_plugin(tmp_path):
    """A docker CLI without the buildx plugin: the message names the plugin and how to get it."""
    result = make("image", DOCKER=str(stub_docker(tmp_path, buildx_works=False)))
    assert result.returncode != 0
    assert "docker buildx is not available" in result.stderr
    assert "docker-buildx-plugin" in result.stderr


def test_make_image_without_engine_names_the_daemon(tmp_path):
    """buildx present but no daemon: the message says no engine is reachable, quoting docker's
    own reason, and nothing is built."""
    docker = stub_docker(tmp_path, buildx_works=True)
    result = make("image", DOCKER=str(docker))
    assert result.returncode != 0
    assert "no Docker engine is reachable" in result.stderr
    assert "Cannot connect to the Docker daemon" in result.stderr
    assert "buildx build" not in (tmp_path / "calls.log").read_text()


def test_make_image_push_without_registry_says_how_to_set_it(tmp_path):
    """REGISTRY unset: non-zero, the message shows the make command with REGISTRY=, and docker is
    never called."""
    docker = stub_docker(tmp_path, buildx_works=True)
    result = make("image-push", DOCKER=str(docker), REGISTRY="")
    assert result.returncode != 0
    assert "REGISTRY is not set" in result.stderr and "make image-push REGISTRY=" in result.stderr
    assert not (tmp_path / "calls.log").exists()


def test_make_image_push_with_registry_goes_on_to_the_docker_checks(tmp_path):
    """With REGISTRY set, the push gets past the registry check and stops at the missing engine."""
    result = make(
        "image-push",
        DOCKER=str(stub_docker(tmp_path, buildx_works=True)),
        REGISTRY="registry.example.com/team",
    )
    assert result.returncode != 0
    assert "REGISTRY" not in result.stderr
    assert "make image-push: error: no Docker engine is reachable" in result.stderr


@pytest.mark.parametrize("offline", [False, True])
def test_pin_base_writes_the_reported_digests_into_pyproject_and_dockerfile(tmp_path, offline):
    """`make pin-base` asks `docker buildx imagetools inspect` for each base tag (OFFLINE=1:
    `docker image inspect` of the bases pulled here) and writes the digests into both files,
    which then agree (the registry and the engine are the parts stood in for here)."""
    project = tmp_path / "project"
    (project / "docker").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", project / "pyproject.toml")
    for name in (
        "Dockerfile",
        "pins.py",
        "lockfile.py",
        "pin-base.sh",
        "requirements.lock",
        "image.env",
    ):
        shutil.copy2(REPO / "docker" / name, project / "docker" / name)
    digests = {"devel": "sha256:" + "1" * 64, "runtime": "sha256:" + "2" * 64}
    docker = tmp_path / "docker"
    docker.write_text(f"""#!/bin/sh
case "$*" in
  "buildx version") exit 0 ;;
  "image inspect pytorch/pytorch:"*-devel*) echo "pytorch/pytorch@{digests["devel"]}" ;;
  "image inspect pytorch/pytorch:"*-runtime*) echo "pytorch/pytorch@{digests["runtime"]}" ;;
  *-devel*) echo '{{"mediaType": "application/vnd.docker.distribution.manifest.v2+json", "digest": "{digests["devel"]}", "size": 1}}' ;;
  *-runtime*) echo '{{"mediaType": "application/vnd.docker.distribution.manifest.v2+json", "digest": "{digests["runtime"]}", "size": 1}}' ;;
  *) exit 1 ;;
esac
""")
    docker.chmod(0o755)
    result = subprocess.run(
        [str(project / "docker" / "pin-base.sh")],
        cwd=project,
        env={
            **os.environ,
            "DOCKER": str(docker),
            "PYTHON": sys.executable,
            "OFFLINE": "1" if offline else "",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    pins_mod = load_tool("pins")
    pins = pins_mod.load_pins(project / "pyproject.toml")
    assert (pins.base_devel_digest, pins.base_runtime_digest) == (
        digests["devel"],
        digests["runtime"],
    )
    dockerfile = (project / "docker" / "Dockerfile").read_text()
    assert pins_mod.dockerfile_problems(pins, dockerfile) == []
    assert f"{pins.base_runtime}@{digests['runtime']}" in dockerfile
