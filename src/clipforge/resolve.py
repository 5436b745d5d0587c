"""`python -m clipforge.resolve STAGE`: the params STAGE runs with, written to resolved/STAGE.yaml.

params.yaml holds what the user chose (a recipe, some keys); a stage runs with that laid over the
recipe's defaults and the embedded ones (clipforge.config). dvc.yaml has one `params` stage per
pipeline stage running this, and makes each pipeline stage depend on its resolved file as its
params. So `dvc exp show`, `dvc params diff` and `dvc exp run -S recipe=production` show the lr,
global batch and ZeRO stage a run really uses, and a change to params.yaml that leaves a stage's
resolved params as they were does not rerun it. The file is a pure function of params.yaml and
the code: it is committed, and rewriting it anywhere gives the same bytes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from clipforge.cli import EXIT_USAGE
from clipforge.config import STAGE_SECTIONS, Config, ConfigError, load_config
from clipforge.fsutil import atomic_write_text

RESOLVED_DIR = Path("resolved")


def resolved_text(stage: str, config: Config) -> str:
    return (
        f"# The params the {stage} stage runs with: params.yaml over its recipe and the embedded\n"
        f"# defaults. Written by `dvc repro` (python -m clipforge.resolve {stage}): edit params.yaml.\n"
        + config.to_yaml()
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clipforge.resolve", description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=sorted(STAGE_SECTIONS))
    parser.add_argument("--params", default="params.yaml", help="default: params.yaml")
    parser.add_argument("--out", type=Path, help="default: resolved/STAGE.yaml")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.params, (), STAGE_SECTIONS[args.stage])
    except ConfigError as exc:
        print(f"clipforge.resolve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = args.out or RESOLVED_DIR / f"{args.stage}.yaml"
    atomic_write_text(out, resolved_text(args.stage, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
