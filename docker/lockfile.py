"""Read docker/requirements.lock and write parts of it, hashes kept.

The lock is one resolution of the image's whole Python stack. It is installed in parts:
- the base image already has torch, torchvision and their CUDA libraries (a conda build of the
  same versions), so the image installs everything else (`--exclude`);
- DeepSpeed is an sdist compiled against the installed torch, so it goes in a second pip call
  with --no-build-isolation, after everything it imports at build time (`--only deepspeed`).

  python docker/lockfile.py docker/requirements.lock --exclude torch 'nvidia-*' deepspeed
  python docker/lockfile.py docker/requirements.lock --only deepspeed

Standard library only: it runs inside the image build on the base image's Python 3.10.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import sys
from dataclasses import dataclass
from pathlib import Path

_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")

# What the base image provides (conda build of the same torch / torchvision, with its own CUDA
# libraries and Triton): never installed from the lock into the image.
PROVIDED_BY_BASE_IMAGE = ("torch", "torchvision", "triton", "nvidia-*")
# Built from source against the installed torch (DeepSpeed publishes no wheels).
BUILT_FROM_SOURCE = ("deepspeed",)


def normalize(name: str) -> str:
    """PEP 503 name normalisation: `Open_Clip.torch` -> `open-clip-torch`."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Entry:
    name: str  # normalised
    version: str
    hashes: tuple[str, ...]
    text: str  # the entry's lines as in the lock, continuation lines and comments included


def parse(text: str) -> list[Entry]:
    """Split a pip-compile/uv lock into entries. Raises ValueError on a line it cannot place, or
    on an entry without hashes (the image installs with --require-hashes)."""
    entries: list[Entry] = []
    block: list[str] = []

    def close() -> None:
        if not block:
            return
        match = _REQUIREMENT.match(block[0])
        if not match:
            raise ValueError(f"lock: not a pinned requirement: {block[0]!r}")
        hashes = tuple(re.findall(r"--hash=(sha256:[0-9a-f]{64})", "".join(block)))
        if not hashes:
            raise ValueError(f"lock: {match.group(1)} has no --hash (regenerate with `make lock`)")
        entries.append(Entry(normalize(match.group(1)), match.group(3), hashes, "".join(block)))
        block.clear()

    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if line[:1].isalnum():
            close()
            block.append(line)
        elif block and (stripped.startswith("--hash=") or stripped.startswith("#") or not stripped):
            block.append(line)
        elif not stripped or stripped.startswith("#"):
            continue  # the header
        else:
            raise ValueError(f"lock: unexpected line: {line!r}")
    close()
    return entries


def matches(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, normalize(p)) for p in patterns)


def select(
    entries: list[Entry], *, only: list[str] | None = None, exclude: list[str] | None = None
) -> list[Entry]:
    chosen = [e for e in entries if only is None or matches(e.name, only)]
    chosen = [e for e in chosen if not (exclude and matches(e.name, exclude))]
    if only:
        missing = [p for p in only if not any(matches(e.name, [p]) for e in entries)]
        if missing:
            raise ValueError(f"lock: no entry matches {missing}")
    return chosen


def render(entries: list[Entry]) -> str:
    return "".join(e.text if e.text.endswith("\n") else e.text + "\n" for e in entries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lockfile.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("lock", type=Path)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--only", nargs="+", metavar="NAME", help="keep these (globs allowed)")
    group.add_argument("--exclude", nargs="+", metavar="NAME", help="drop these (globs allowed)")
    args = parser.parse_args(argv)
    try:
        entries = select(
            parse(args.lock.read_text(encoding="utf-8")), only=args.only, exclude=args.exclude
        )
    except (OSError, ValueError) as exc:
        print(f"lockfile.py: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
