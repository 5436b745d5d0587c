"""Typed, documented, self-checking config fields: the machinery behind every params section.

A section is a keyword-only dataclass deriving from `Section`; each field is declared with
`knob(default, doc, ge=..., le=...)`. Constructing a section checks every field's type and
range and raises `ConfigError` naming `section.key` and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any, ClassVar, Literal, Union

from clipforge.errors import UserError


class ConfigError(UserError, ValueError):
    """A parameter problem the user must fix; the message names the key and what is allowed."""


def knob(default: Any, doc: str, **limits: Any) -> Any:
    """A documented config field. limits: ge, gt, le, lt (numbers), nonempty (strings/lists).
    `default=REQUIRED`: an Entry's key that every entry must give (eval.suites[i].name)."""
    if default is REQUIRED:
        return field(metadata={"doc": doc, **limits})
    if isinstance(default, (list, dict)):
        return field(
            default_factory=lambda: copy.deepcopy(default), metadata={"doc": doc, **limits}
        )
    return field(default=default, metadata={"doc": doc, **limits})


REQUIRED: Any = dataclasses.MISSING


class Section:
    """Base of every params section: each field is checked (type, range) on construction,
    so a section object that exists is valid, wherever it was built."""

    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]  # every Section is one
            key = f"{self.SECTION}.{f.name}"
            object.__setattr__(
                self, f.name, _check_value(key, getattr(self, f.name), hints[f.name], f.metadata)
            )


class Entry:
    """An item of a list knob (each of eval.suites): a mapping of knobs, checked like a section
    but named by its place (`eval.suites[1].kind`). `check(key)` holds the checks across keys."""

    @classmethod
    def build(cls, key: str, value: Any) -> Any:
        if isinstance(value, cls):
            return value
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: got {value!r}; must be a mapping of {', '.join(fields)}")
        unknown = [name for name in value if name not in fields]
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}: unknown key; allowed: {', '.join(fields)}")
        missing = [
            name
            for name, f in fields.items()
            if name not in value
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(
                f"{key}: {missing[0]} is required ({fields[missing[0]].metadata['doc']})"
            )
        hints = typing.get_type_hints(cls)
        entry = cls(
            **{
                name: _check_value(f"{key}.{name}", item, hints[name], fields[name].metadata)
                for name, item in value.items()
            }
        )
        entry.check(key)
        return entry

    def check(self, key: str) -> None:
        """Checks across this entry's keys; ConfigError naming `key.name`."""


def _check_value(key: str, value: Any, hint: Any, limits: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, Entry):
        return hint.build(key, value)
    if origin is Union or origin is types.UnionType:  # Optional[X] and X | None alike
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: must be set; null is not allowed")
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _check_value(key, value, option, limits)
            except ConfigError as exc:
                errors.append(str(exc).split("; ", 1)[-1])
        raise ConfigError(f"{key}: got {value!r}; " + "; or ".join(errors))
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: got {value!r}; must be a list, e.g. [a, b]")
        return [_check_value(f"{key}[{i}]", item, args[0], {}) for i, item in enumerate(value)]
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: got {value!r}; allowed: {', '.join(map(str, args))}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: got {value!r}; must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: got {value!r}; must be an integer{_range_text(limits)}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: got {value!r}; must be a number{_range_text(limits)}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key}: got {value!r}; must be a finite number{_range_text(limits)}")
    elif hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: got {value!r}; must be a string")
        if limits.get("nonempty") and not value.strip():
            raise ConfigError(f"{key}: must not be empty")
        return value
    else:  # pragma: no cover - a field type this loader does not know is a programming error
        raise TypeError(f"{key}: unsupported field type {hint}")
    _check_range(key, value, limits)
    return value


def _check_range(key: str, value: float, limits: Any) -> None:
    bad = (
        ("ge" in limits and value < limits["ge"])
        or ("gt" in limits and value <= limits["gt"])
        or ("le" in limits and value > limits["le"])
        or ("lt" in limits and value >= limits["lt"])
    )
    if bad:
        raise ConfigError(f"{key}: got {value!r}; must be{_range_text(limits)}")


def _range_text(limits: Any) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{words[k]} {limits[k]}" for k in words if k in limits]
    return (" " + " and ".join(parts)) if parts else ""
