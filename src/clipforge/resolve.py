"""The params stages: the params a pipeline stage runs with, written to resolved/<stage>.yaml.

A stage runs with its sections of params.yaml, every key spelt out (one left out of the file at
its section's default: clipforge.config). dvc.yaml has one `params-<stage>` stage per pipeline
stage, running `python -m clipforge.<stage>.config` (its module of params, which calls `main`
here), and makes each pipeline stage depend on its resolved file as its params. So a change to
params.yaml that leaves a stage's resolved params as they were does not rerun it, and a new
default in a section's code that does reruns it; a params stage depends only on its own stage's
sections, their code and keys. The file is a pure function of params.yaml and the code: it is
committed, and rewriting it anywhere gives the same bytes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from clipforge.cli import EXIT_USAGE
from clipforge.config import Params, load_params
from clipforge.fields import ConfigError
from clipforge.fsutil import atomic_write_text

RESOLVED_DIR = Path("resolved")


def resolved_text(stage: str, config: Params) -> str:
    module = f"clipforge.{stage}.config"
    return (
        f"# The params the {stage} stage runs with: its sections of params.yaml, every key spelt out.\n"
        f"# Written by `dvc repro` (python -m {module}): edit params.yaml, not this.\n"
        + config.to_yaml()
    )


def main(stage: str, params: type[Params], argv: Sequence[str] | None = None) -> int:
    """`python -m clipforge.<stage>.config [--params FILE] [--out FILE]`."""
    parser = argparse.ArgumentParser(
        prog=f"clipforge.{stage}.config", description=f"write resolved/{stage}.yaml"
    )
    parser.add_argument("--params", default="params.yaml", help="default: params.yaml")
    parser.add_argument("--out", type=Path, help=f"default: resolved/{stage}.yaml")
    args = parser.parse_args(argv)
    try:
        config = load_params(params, args.params)
    except ConfigError as exc:
        print(f"clipforge.{stage}.config: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = args.out or RESOLVED_DIR / f"{stage}.yaml"
    atomic_write_text(out, resolved_text(stage, config))
    return 0
