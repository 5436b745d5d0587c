"""`python -m clipforge.pipeline.recipe NAME`: write recipe NAME's values into params.yaml.

params.yaml is what runs: nothing is laid over it when a stage loads it, so a recipe
(clipforge.recipes) is applied by writing it there. Writing recipe NAME sets every key that any
recipe sets to NAME's value (the embedded default where NAME leaves it out), so that going from
one recipe to another leaves nothing of the first; every other key (the alerts, the run store...)
keeps its value. The file is rewritten whole, every knob under its doc
(clipforge.pipeline.params_file). `git diff params.yaml` then shows what the recipe changed,
`dvc exp run` runs it, and `fab train` ships it once committed.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from pathlib import Path

from clipforge.cli import EXIT_USAGE
from clipforge.config import read_params, resolve
from clipforge.fields import ConfigError
from clipforge.fsutil import atomic_write_text
from clipforge.pipeline.params import PipelineParams
from clipforge.pipeline.params_file import render
from clipforge.recipes import RECIPES


def recipe_keys() -> dict[str, set[str]]:
    """Section -> the keys some recipe sets: what writing a recipe decides."""
    keys: dict[str, set[str]] = {}
    for recipe in RECIPES.values():
        for section, values in recipe.items():
            keys.setdefault(section, set()).update(values)
    return keys


def with_recipe(values: dict[str, dict], name: str) -> dict[str, dict]:
    """`values` (section -> key -> value) with recipe `name` written in."""
    embedded = PipelineParams().to_dict()
    written = copy.deepcopy(values)
    for section, keys in recipe_keys().items():
        chosen = RECIPES[name].get(section, {})
        for key in keys:
            written.setdefault(section, {})[key] = chosen.get(key, embedded[section][key])
    return written


def recipe_params(name: str) -> PipelineParams:
    """What a params.yaml of the embedded defaults runs once recipe `name` is written into it."""
    return resolve(PipelineParams, with_recipe(PipelineParams().to_dict(), name))


def changes(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """`section.key: old -> new` for each value that differs."""
    return [
        f"{section}.{key}: {before[section][key]!r} -> {value!r}"
        for section, values in after.items()
        for key, value in values.items()
        if before[section][key] != value
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="clipforge.pipeline.recipe", description=__doc__.split("\n")[0]
    )
    parser.add_argument("name", choices=sorted(RECIPES), help="the recipe to write")
    parser.add_argument(
        "--params", type=Path, default=Path("params.yaml"), help="default: params.yaml"
    )
    args = parser.parse_args(argv)
    try:
        raw = read_params(args.params)
        raw.pop("recipe", None)  # the key that once named a recipe laid over the file
        before = resolve(PipelineParams, raw).to_dict()
        after = resolve(PipelineParams, with_recipe(before, args.name)).to_dict()
    except ConfigError as exc:
        print(f"clipforge.pipeline.recipe: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    atomic_write_text(args.params, render(after))
    changed = changes(before, after)
    print(
        f"{args.params}: recipe {args.name} written, {len(changed)} value(s) changed"
        + "".join(f"\n  {line}" for line in changed)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
