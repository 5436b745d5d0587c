"""params.yaml as a file: every knob of every section, under its doc, with the value that runs.

`render` writes it from values: the recipe command (clipforge.pipeline.recipe), and `python -m
clipforge.pipeline.params_file`, which rewrites the file from its own values after a knob is
added or a doc edited. A test holds the committed file to what that writes: no key missing, no
doc stale.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from clipforge.cli import EXIT_USAGE
from clipforge.config import read_params, resolve
from clipforge.fields import ConfigError
from clipforge.fsutil import atomic_write_text
from clipforge.pipeline.params import PipelineParams, field_docs
from clipforge.recipes import RECIPES_DOC

WIDTH = 100
_NBSP = "\u00a0"  # holds a quoted command together while a comment is wrapped
HEADER = (
    "clipforge parameters, one section per pipeline stage, every key under its doc. What this "
    "file says is what runs: nothing is laid over it (resolved/<stage>.yaml holds a stage's "
    "sections of it, as the stage loads them).",
    "Types, ranges and checks live in src/clipforge/<stage>/config.py; a bad value fails before "
    "any work.",
    "For one run: `python -m clipforge.<stage> --set train.lr=1e-4`, or `dvc exp run -S "
    "train.lr=1e-4`.",
    "A recipe is written into this file, which then holds its values: "
    "`python -m clipforge.pipeline.recipe NAME` (git diff shows what it changed). Recipes: "
    f"{RECIPES_DOC}.",
)
# The comment above each section.
SECTION_HEADINGS = {
    "data": "--- Data stage (python -m clipforge.data): source -> data/ shards + test set",
    "model": "--- Model: an open_clip architecture, built by the train stage",
    "train": "--- Train stage (python -m clipforge.train): DeepSpeed, always",
    "eval": "--- Eval stage (python -m clipforge.eval): retrieval recall and zero-shot accuracy "
    "per test suite",
    "alerts": "--- Alerts during training (rank 0 watches the loss and stalls; each node's local "
    "rank 0 its GPUs). Webhook URLs are secrets: CLIPFORGE_ALERT_WEBHOOKS in the environment, "
    "never here (docs/alerts.md).",
    "storage": "--- Run store: the run copied to object storage while it trains, so it outlives "
    'its host (docs/launcher.md, "My box died at 3 a.m."). Credentials come from the '
    "environment, never here.",
}


def comment(text: str, indent: str = "") -> list[str]:
    """`text` as comment lines of at most WIDTH columns (ids, URLs and `quoted commands` are
    never split)."""
    prefix = f"{indent}# "
    kept = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", _NBSP), text)
    lines = textwrap.wrap(kept, WIDTH - len(prefix), break_on_hyphens=False, break_long_words=False)
    return [prefix + line.replace(_NBSP, " ") for line in lines]


class _Dumper(yaml.SafeDumper):
    """Block style, a list's items indented under their key (as people write YAML)."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> Any:
        return super().increase_indent(flow, False)


def value_lines(key: str, value: Any, indent: str) -> list[str]:
    text = yaml.dump({key: value}, Dumper=_Dumper, sort_keys=False, allow_unicode=True)
    return [indent + line for line in text.splitlines()]


def render(values: dict[str, dict]) -> str:
    """params.yaml holding `values` (section -> key -> value, every knob)."""
    docs = field_docs()
    lines = [line for paragraph in HEADER for line in comment(paragraph)]
    for section in PipelineParams.sections():
        lines += ["", *comment(SECTION_HEADINGS[section]), f"{section}:"]
        for key, value in values[section].items():
            lines += comment(docs[f"{section}.{key}"], "  ")
            lines += value_lines(key, value, "  ")
    return "\n".join(lines) + "\n"


def rewritten(path: str | Path) -> str:
    """The params file at `path` as `render` writes its values (ConfigError when it has none)."""
    return render(resolve(PipelineParams, read_params(path)).to_dict())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="clipforge.pipeline.params_file",
        description="rewrite a params file from its own values: every knob under its doc",
    )
    parser.add_argument(
        "--params", type=Path, default=Path("params.yaml"), help="default: params.yaml"
    )
    args = parser.parse_args(argv)
    try:
        text = rewritten(args.params)
    except ConfigError as exc:
        print(f"clipforge.pipeline.params_file: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    atomic_write_text(args.params, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
