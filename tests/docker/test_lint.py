"""Static checks of the image's files: hadolint on the Dockerfile, shellcheck on the scripts."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.docker.conftest import DOCKER_DIR, dev_tool

DOCKERFILE = DOCKER_DIR / "Dockerfile"
# hadolint levels above `info`: a warning or error is a defect of the image (an unpinned package,
# a shell pitfall), while `info` and `style` findings are suggestions, so only these two fail.
ABOVE_INFO = {"error", "warning"}
# Rules the Dockerfile may silence, each with the reason written above the pragma.
ALLOWED_IGNORES = {"DL3008"}  # exact apt pins: Ubuntu deletes superseded versions


def hadolint(text: str) -> list[dict]:
    result = subprocess.run(
        [dev_tool("hadolint"), "--format", "json", "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.stdout.strip(), result.stderr
    return json.loads(result.stdout)


DOCKERFILES = (DOCKERFILE, DOCKER_DIR / "Dockerfile.cpu")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_has_no_hadolint_finding_above_info(dockerfile):
    """hadolint reports no warning or error on the GPU image's Dockerfile and the CPU image's."""
    findings = hadolint(dockerfile.read_text(encoding="utf-8"))
    assert [f for f in findings if f["level"] in ABOVE_INFO] == []


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_silences_only_the_documented_rule_and_it_is_still_needed(dockerfile):
    """The only `hadolint ignore` is DL3008, and without the pragma hadolint would report it:
    no stale or undocumented suppressions."""
    text = dockerfile.read_text(encoding="utf-8")
    ignored = set(re.findall(r"#\s*hadolint ignore=([A-Z0-9,]+)", text))
    assert {rule for group in ignored for rule in group.split(",")} == ALLOWED_IGNORES
    unsilenced = re.sub(r"^#\s*hadolint ignore=.*\n", "", text, flags=re.MULTILINE)
    assert {f["code"] for f in hadolint(unsilenced)} == ALLOWED_IGNORES


def test_shell_scripts_pass_shellcheck():
    """Every docker/*.sh passes shellcheck (sourced files followed)."""
    scripts = sorted(str(p) for p in DOCKER_DIR.glob("*.sh"))
    result = subprocess.run(
        [dev_tool("shellcheck"), "--external-sources", *scripts],
        cwd=DOCKER_DIR.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
