"""params.yaml -> a stage's typed params: read, checked, and `--set` over them.

params.yaml is what runs. A stage's params are its sections of the file, a key left out taking
its section's default, with `--set section.key=value` (YAML-parsed, like `dvc exp run -S`) over
them for one run; nothing else is laid over the file. A recipe (clipforge.recipes) is written into
it (`python -m clipforge.pipeline.recipe NAME`), so a value there is never ignored for being equal
to a default, and `--print-config` and resolved/<stage>.yaml show what trains. A `recipe` key is
refused, naming the values it would change.

Each stage owns its sections (clipforge.data.config, clipforge.train.config, clipforge.eval.config,
and the sections they share: model, alerts, storage) and declares the params it reads as a
`Params` subclass; `load_params` is the only way a stage gets them, so every check runs before
any heavy import or file write. A stage builds and checks only the sections it reads: a bad
`train.*` value stops the train stage, not the data stage. What every stage checks: the file's
YAML, its top-level keys (the sections of SECTION_NAMES), and the keys and values of its own
sections.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from clipforge import util
from clipforge.fields import ConfigError, Section
from clipforge.recipes import RECIPES
from clipforge.yamlfile import YamlFileError, load_yaml, read_yaml_file

# Every section params.yaml may hold, in the file's order; each stage reads some of them.
SECTION_NAMES = ("data", "model", "train", "eval", "alerts", "storage")
RECIPE_COMMAND = "python -m clipforge.pipeline.recipe"

P = TypeVar("P", bound="Params")


@dataclass(kw_only=True)
class Params:
    """Base of the params a stage reads: its sections, each a field whose type is a
    fields.Section (built and checked by `load_params`)."""

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        """The sections these params hold: name -> its Section class, in declaration order."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


def load_params(
    params: type[P], params_path: str | Path | None = "params.yaml", overrides: Sequence[str] = ()
) -> P:
    """Read params and `--set` overrides, validate; raise ConfigError naming the key.
    `params_path` None: no file (the sections' defaults, and the overrides)."""
    raw = read_params(params_path) if params_path is not None else {}
    forced: dict = {}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(forced, key, value)
    return resolve(params, raw, forced)


def resolve(params: type[P], raw: dict, forced: dict | None = None) -> P:
    """params mapping (+ `forced` values that win over it, e.g. --set) -> validated `params`."""
    forced = forced or {}
    for name, mapping in (("params", raw), ("overrides", forced)):
        if not isinstance(mapping, dict):
            raise ConfigError(f"{name} must be a mapping of sections, got {type(mapping).__name__}")
        _check_names(name, mapping)
        if "recipe" in mapping:
            raise ConfigError(_recipe_refusal(params, raw, forced))
        unknown = sorted(set(mapping) - set(SECTION_NAMES))
        if unknown:
            raise ConfigError(
                f"unknown top-level key {util.short_repr(unknown[0])}: allowed are "
                f"{sorted(SECTION_NAMES)}"
            )
    for name in SECTION_NAMES:  # a section given as something else than a mapping, in any
        _section_values(raw, name)
        _section_values(forced, name)
    built = {}
    for section, cls in params.sections().items():
        embedded = cls().to_dict()
        merged = {
            **embedded,
            **dict(_section_items(raw, section, embedded)),
            **dict(_section_items(forced, section, embedded)),
        }
        built[section] = cls(**merged)  # each section checks itself on construction
    return params(**built)


def _recipe_refusal(params: type[Params], raw: dict, forced: dict) -> str:
    """Why a `recipe` key is refused, with the values of this stage it would change (those
    given in the file or with --set first)."""
    where = "--set recipe" if "recipe" in forced else "params.yaml's `recipe` key"
    name = forced["recipe"] if "recipe" in forced else raw["recipe"]
    if not isinstance(name, str) or name not in RECIPES:
        return (
            f"recipe: {where} is {util.short_repr(name)}, but params.yaml is what runs and nothing is laid "
            f"over it: write a recipe into params.yaml with `{RECIPE_COMMAND} NAME` (NAME: "
            f"{', '.join(RECIPES)}) and remove the key"
        )
    conflicts = []
    for section, cls in params.sections().items():
        given = {**_section_values(raw, section), **_section_values(forced, section)}
        current = {**cls().to_dict(), **given}
        conflicts += [
            (
                key not in given,
                f"{section}.{key}: {util.short_repr(current.get(key))} here, {value!r} in {name}",
            )
            for key, value in RECIPES[name].get(section, {}).items()
            if current.get(key) != value
        ]
    shown = [text for _, text in sorted(conflicts, key=lambda c: c[0])[:2]]
    changes = (
        f"; {name} would change {len(conflicts)} of this stage's values ("
        + "; ".join(shown + (["..."] if len(conflicts) > len(shown) else []))
        + ")"
        if conflicts
        else ""
    )
    return (
        f"recipe: {where} names {name}, but params.yaml is what runs and nothing is laid over "
        f"it{changes}: write the recipe into params.yaml with `{RECIPE_COMMAND} {name}` (then "
        f"change what you want there) and remove the key"
    )


def _check_names(where: str, mapping: dict) -> None:
    """Keys are names: a YAML key like `1:` or `true:` would otherwise fail far from here."""
    for key in mapping:
        if not isinstance(key, str):
            raise ConfigError(
                f"{where}: key {util.short_repr(key)} is not a name; keys are words like `train`"
            )


def _section_values(mapping: dict, section: str) -> dict:
    values = mapping.get(section)
    if values is None:  # `train:` with nothing under it: an empty section
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{section}: must be a mapping of keys, got {util.short_repr(values)}")
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
        raise ConfigError(
            f"--set {util.short_repr(item)}: expected section.key=value, e.g. train.lr=1e-4"
        )
    try:
        value = load_yaml(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--set {util.short_repr(item)}: value is not valid YAML ({_yaml_problem(exc)})"
        ) from None
    return key.strip(), value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What a parser error says, without its position (a --set value is one short line)."""
    return getattr(exc, "problem", None) or util.first_line(exc)


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) == 1 and parts[0] == "recipe":  # refused, with the remedy, by `resolve`
        raw["recipe"] = value
        return
    if len(parts) != 2:
        raise ConfigError(
            f"--set {key}: expected section.key (sections: {', '.join(SECTION_NAMES)})"
        )
    section, name = parts
    if section not in SECTION_NAMES:
        raise ConfigError(
            f"--set {key}: unknown section {util.short_repr(section)}; sections: {', '.join(SECTION_NAMES)}"
        )
    raw.setdefault(section, {})
    if raw[section] is None:
        raw[section] = {}
    raw[section][name] = value


def read_params(path: str | Path) -> dict:
    """params.yaml's mapping, its YAML checked; ConfigError naming the file otherwise."""
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
            f"{path}: sets no parameters; write the defaults into it with `{RECIPE_COMMAND} "
            f"default`"
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: must be a mapping of sections ({', '.join(SECTION_NAMES)}), "
            f"got a {type(raw).__name__}"
        )
    return raw
