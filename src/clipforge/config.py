"""params.yaml -> a stage's typed params: read, layered, validated.

Each stage owns its sections (clipforge.data.config, clipforge.train.config, clipforge.eval.config,
and the sections they share: model, alerts, storage) and declares the params it reads as a
`Params` subclass; `load_params` is the only way a stage gets them, so every check runs before
any heavy import or file write. A stage builds and checks only the sections it reads: a bad
`train.*` value stops the train stage, not the data stage. What every stage checks: the file's
YAML, its top-level keys (the sections of SECTION_NAMES and `recipe`), and the keys and values of
its own sections.

Layering, lowest first:
  1. the embedded default (the field defaults of each section: a tiny model that trains in
     minutes on CPU);
  2. the recipe named by the top-level `recipe` key (`clipforge.recipes`): a different set of
     defaults, e.g. the production ViT-B/32 run;
  3. params.yaml: a key whose value differs from the embedded default is the user's choice and
     wins over the recipe (so `dvc exp run -S recipe=production -S train.lr=1e-4` does what it says);
  4. `--set section.key=value` (YAML-parsed, like `dvc exp run -S`).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from clipforge.fields import ConfigError, Section, knob
from clipforge.recipes import RECIPES, RECIPES_DOC
from clipforge.yamlfile import YamlFileError, load_yaml, read_yaml_file

# Every section params.yaml may hold, in the file's order; each stage reads some of them.
SECTION_NAMES = ("data", "model", "train", "eval", "alerts", "storage")

P = TypeVar("P", bound="Params")


@dataclass(kw_only=True)
class Params:
    """Base of the params a stage reads: `recipe` and the stage's sections, each a field whose
    type is a fields.Section (built and checked by `load_params`)."""

    recipe: str = knob("default", RECIPES_DOC)  # each recipe's gist, read off the recipe

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        """The sections these params hold: name -> its Section class, in declaration order."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "recipe"}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


def load_params(
    params: type[P], params_path: str | Path | None = "params.yaml", overrides: Sequence[str] = ()
) -> P:
    """Read params, apply recipe and overrides, validate; raise ConfigError naming the key.
    `params_path` None: no file (the embedded defaults, and the recipe `overrides` may name)."""
    raw = _read_params(params_path) if params_path is not None else {}
    forced: dict = {}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(forced, key, value)
    return resolve(params, raw, forced)


def resolve(params: type[P], raw: dict, forced: dict | None = None) -> P:
    """params mapping (+ `forced` values that always win, e.g. --set) -> validated `params`."""
    forced = forced or {}
    for name, mapping in (("params", raw), ("overrides", forced)):
        if not isinstance(mapping, dict):
            raise ConfigError(f"{name} must be a mapping of sections, got {type(mapping).__name__}")
        known = {"recipe", *SECTION_NAMES}
        _check_names(name, mapping)
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ConfigError(f"unknown top-level key {unknown[0]!r}: allowed are {sorted(known)}")
    recipe = forced.get("recipe", raw.get("recipe", "default"))
    if not isinstance(recipe, str):
        raise ConfigError(
            f"recipe: got {recipe!r}; must be the name of a recipe: {sorted(RECIPES)}"
        )
    if recipe not in RECIPES:
        raise ConfigError(f"recipe: unknown recipe {recipe!r}: allowed are {sorted(RECIPES)}")
    for name in SECTION_NAMES:  # a section given as something else than a mapping, in any
        _section_values(raw, name)
        _section_values(forced, name)

    built = {}
    for section, cls in params.sections().items():
        embedded = cls().to_dict()
        merged = {**embedded, **RECIPES[recipe].get(section, {})}
        recipe_keys = RECIPES[recipe].get(section, {})
        for key, value in _section_items(raw, section, embedded):
            # A value still equal to the embedded default is not a choice: the recipe's applies.
            if key not in recipe_keys or not _is_embedded_default(cls, key, value, embedded):
                merged[key] = value
        merged.update(_section_items(forced, section, embedded))
        built[section] = cls(**merged)  # each section checks itself on construction
    return params(recipe=recipe, **built)


def _is_embedded_default(cls: type[Section], key: str, value: Any, embedded: dict) -> bool:
    """Is `value` the embedded default, also when written shorter: a list of entries (eval.suites)
    whose entries leave out keys at their defaults is the same list."""
    if value == embedded[key]:
        return True
    if not isinstance(value, list):
        return False
    try:
        built = cls(**{key: value})
    except ConfigError:
        return False  # not the default, and an error the section reports when it is built
    return built.to_dict()[key] == embedded[key]


def _check_names(where: str, mapping: dict) -> None:
    """Keys are names: a YAML key like `1:` or `true:` would otherwise fail far from here."""
    for key in mapping:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key {key!r} is not a name; keys are words like `train`")


def _section_values(mapping: dict, section: str) -> dict:
    values = mapping.get(section)
    if values is None:  # `train:` with nothing under it: an empty section
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{section}: must be a mapping of keys, got {values!r}")
    _check_names(section, values)
    return values


def _section_items(mapping: dict, section: str, embedded: dict) -> list[tuple[str, Any]]:
    values = _section_values(mapping, section)
    for key in values:
        if key not in embedded:
            raise ConfigError(f"{section}.{key}: unknown key; {section} has: {', '.join(embedded)}")
    return list(values.items())


def parse_override(item: str) -> tuple[str, Any]:
    """`train.lr=1e-4` -> ("train.lr", 0.0001). The value is YAML, as with `dvc exp run -S`."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=1e-4")
    try:
        value = load_yaml(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item!r}: value is not valid YAML ({exc.problem})") from None
    return key.strip(), value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) == 1 and parts[0] == "recipe":
        raw["recipe"] = value
        return
    if len(parts) != 2:
        raise ConfigError(
            f"--set {key}: expected section.key (sections: {', '.join(SECTION_NAMES)})"
        )
    section, name = parts
    if section not in SECTION_NAMES:
        raise ConfigError(
            f"--set {key}: unknown section {section!r}; sections: {', '.join(SECTION_NAMES)}"
        )
    raw.setdefault(section, {})
    if raw[section] is None:
        raw[section] = {}
    raw[section][name] = value


def _read_params(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"params file {path} not found: run from the project root or pass --params"
        )
    try:
        raw = read_yaml_file(path)
    except YamlFileError as exc:
        raise ConfigError(str(exc)) from None
    # A file that sets nothing is a mistake (a truncated copy, a wrong --params), not a request
    # for the embedded defaults: running on them would give a result nobody asked for.
    if raw is None or raw == {}:
        raise ConfigError(
            f"{path}: sets no parameters; write at least `recipe: default` to run on the "
            f"embedded defaults"
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: must be a mapping of sections (recipe, {', '.join(SECTION_NAMES)}), "
            f"got a {type(raw).__name__}"
        )
    return raw
