"""docker/image.env, the one place that names the training image, read by one grammar.

The same file is included by the Makefile (`include docker/image.env`), sourced by
docker/build.sh and read here (by infra/ for `make up`, by the launcher, by docker/pins.py). Make
keeps quotes and trailing spaces as part of a value and treats `#` as a comment and `$` as a
reference, where the shell does otherwise; so that all three read the same values, a line is:
- blank, or a comment (`#` first, after optional spaces), or
- `NAME=VALUE` with nothing around the `=` and a VALUE of letters, digits and `. _ - : / @ +`
  only: no quotes, spaces, `#` or `$`.
Anything else is refused with the line's number and what to write instead.

Standard library only: docker/pins.py runs it with the Makefile's Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from clipforge.errors import UserError
from clipforge.util import short_repr

ORIGIN = "docker/image.env"
REQUIRED = ("IMAGE_REPOSITORY", "IMAGE_TAG")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=([A-Za-z0-9._:/@+-]+)")
_FORM = "write NAME=VALUE, the value made of letters, digits and . _ - : / @ + only"


class ImageEnvError(UserError, ValueError):
    """docker/image.env is missing, malformed or lacks a key; the message names the line or key."""


@dataclass(frozen=True)
class ImageEnv:
    values: dict[str, str]
    origin: str  # where it was read, for messages

    def reference(self, registry: str | None = None) -> str:
        """`[registry/]IMAGE_REPOSITORY:IMAGE_TAG`; no registry (None or "") means a local name."""
        missing = [key for key in REQUIRED if key not in self.values]
        if missing:
            raise ImageEnvError(
                f"{self.origin}: {' and '.join(missing)} missing: it names the "
                f"training image ({'=..., '.join(REQUIRED)}=...)"
            )
        ref = f"{self.values['IMAGE_REPOSITORY']}:{self.values['IMAGE_TAG']}"
        return f"{registry.rstrip('/')}/{ref}" if registry else ref


def parse_image_env(text: str, origin: str = ORIGIN) -> ImageEnv:
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _ASSIGNMENT.fullmatch(line)
        if not match:
            raise ImageEnvError(
                f"{origin}:{number}: {short_repr(line)}: {_problem(line)}; {_FORM} "
                f"(make, the shell and Python must read the same value)"
            )
        name, value = match.groups()
        if name in values:
            raise ImageEnvError(f"{origin}:{number}: {name} is set twice; keep one line")
        values[name] = value
    return ImageEnv(values=values, origin=origin)


def read_image_env(path: Path) -> ImageEnv:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ImageEnvError(
            f"{path} not found: it names the training image ({'=..., '.join(REQUIRED)}=...)"
        ) from None
    return parse_image_env(text, origin=str(path))


def _problem(line: str) -> str:
    name, sep, value = line.partition("=")
    if not sep:
        return "not an assignment"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return (
            f"{short_repr(name.strip())} is not a variable name"
            if name.strip() == name
            else "spaces around the name"
        )
    if not value:
        return "no value"
    for chars, what in (
        ("'\"", "quotes (kept by make as part of the value)"),
        (" \t", "spaces"),
        ("#", "a `#` (a comment to make)"),
        ("$", "a `$` (expanded by make and the shell)"),
    ):
        if any(c in value for c in chars):
            return what
    return "a character outside the allowed ones"
