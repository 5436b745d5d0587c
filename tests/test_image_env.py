"""docker/image.env: one grammar, the values make and the shell read too, one error style."""

from __future__ import annotations

import subprocess

import pytest

from clipforge.image_env import ImageEnvError, parse_image_env, read_image_env
from tests.conftest import REPO

IMAGE_ENV = REPO / "docker" / "image.env"


def _make_value(name: str) -> str:
    makefile = f"include {IMAGE_ENV}\nshow:\n\t@printf '%s' '$({name})'\n"
    return subprocess.run(
        ["make", "--no-print-directory", "-s", "-f", "-", "show"],
        input=makefile,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _shell_value(name: str) -> str:
    return subprocess.run(
        ["sh", "-c", f'. "$0" && printf %s "${name}"', str(IMAGE_ENV)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_the_image_env_reads_the_same_in_make_the_shell_and_python():
    """The Makefile includes the file, docker/build.sh sources it: every value is the same for them."""
    image_env = read_image_env(IMAGE_ENV)
    assert set(image_env.values) >= {"IMAGE_REPOSITORY", "IMAGE_TAG"}
    for name, value in image_env.values.items():
        assert _make_value(name) == value == _shell_value(name), name


def test_reference_is_repository_and_tag_behind_an_optional_registry():
    """[$REGISTRY/]IMAGE_REPOSITORY:IMAGE_TAG; comments and blank lines are skipped."""
    image_env = parse_image_env(
        "# the image\n\nIMAGE_REPOSITORY=clipforge\n  # indented\nIMAGE_TAG=1.2-cu121\n"
    )
    assert image_env.reference(None) == image_env.reference("") == "clipforge:1.2-cu121"
    assert image_env.reference("ghcr.io/team/") == "ghcr.io/team/clipforge:1.2-cu121"


@pytest.mark.parametrize(
    "line, problem",
    [
        ('IMAGE_TAG="1.2"', "quotes"),
        ("IMAGE_TAG='1.2'", "quotes"),
        ("IMAGE_TAG=1.2 # the tag", "spaces"),
        ("IMAGE_TAG=1.2#x", "a `#`"),
        ("IMAGE_TAG=$(TAG)", "a `$`"),
        ("IMAGE_TAG = 1.2", "spaces around the name"),
        ("IMAGE_TAG=", "no value"),
        ("export IMAGE_TAG", "not an assignment"),
    ],
)
def test_a_line_outside_the_grammar_is_refused_with_its_number_and_the_form(line, problem):
    """Quotes, spaces, `#`, `$`, an empty value or no `=`: the error names the file and line,
    what is wrong, and the form to write."""
    with pytest.raises(ImageEnvError) as caught:
        parse_image_env(f"IMAGE_REPOSITORY=clipforge\n{line}\n", origin="docker/image.env")
    message = str(caught.value)
    assert message.startswith("docker/image.env:2: ") and problem in message
    assert "write NAME=VALUE" in message


def test_a_missing_key_or_file_is_named():
    """No IMAGE_TAG, a key set twice, no file at all: each named, with what the file is for."""
    with pytest.raises(ImageEnvError, match="docker/image.env: IMAGE_TAG missing"):
        parse_image_env("IMAGE_REPOSITORY=clipforge\n").reference()
    with pytest.raises(ImageEnvError, match=":2: IMAGE_TAG is set twice"):
        parse_image_env("IMAGE_TAG=a\nIMAGE_TAG=b\n")
    with pytest.raises(ImageEnvError, match="not found: it names the training image"):
        read_image_env(REPO / "no-such-dir" / "image.env")
