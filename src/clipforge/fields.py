"""Typed, documented, self-checking config fields: the machinery behind every params section.

A section is a keyword-only dataclass deriving from `Section`; each field is declared with
`knob(default, doc, ge=..., le=...)`. Constructing a section checks every field's type and
range and raises `ConfigError` naming `section.key` and what is allowed. The infra's stack
config (infra/clipforge_infra/settings.py) is a section too: its keys are spelt the Pulumi way
(`key_of`), its checks raise its own ConfigError subclass (`ERROR`), and a field's `check=`
carries what a type and a range cannot say (a Kubernetes name, a quantity). The launcher's
settings (fabric.yaml), `fab train`'s options and the supervisor's restart policy are sections
too, raising the launcher's user error and spelt as the user sets them (`clipforge.key`,
`--flag`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

from clipforge.errors import UserError
from clipforge.util import short_repr

# The largest seed: torch.manual_seed takes 0..2**64-1 (a larger one failed after the whole
# start-up); numpy's generators, seeded with [seed, ...] lists, take any size. One range for every
# seed knob.
MAX_SEED = 2**64 - 1


class ConfigError(UserError, ValueError):
    """A parameter problem the user must fix; the message names the key and what is allowed."""


def knob(default: Any, doc: str, **limits: Any) -> Any:
    """A documented config field. limits: ge, gt, le, lt (numbers), nonempty (strings/lists);
    path: True for a path (or list of paths) the OS is handed, checked by `check_path`;
    check: `fn(key, value) -> value`, run after the type and range checks, raising the section's
    ERROR naming `key` (it may normalise the value); secret: True keeps the value out of the
    section's repr (the infra's SSH key, webhooks). Other keywords are kept in the metadata.
    `default=REQUIRED`: a key that must be given (eval.suites[i].name; every stack key, whose
    defaults live in Pulumi.yaml)."""
    metadata = {"doc": doc, **limits}
    shown = not limits.get("secret")  # a secret's value stays out of the section's repr
    if default is REQUIRED:
        return field(metadata=metadata, repr=shown)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata, repr=shown)
    return field(default=default, metadata=metadata, repr=shown)


REQUIRED: Any = dataclasses.MISSING


class Section:
    """Base of every params section: each field is checked (type, range) on construction,
    so a section object that exists is valid, wherever it was built."""

    SECTION: ClassVar[str]
    # What a bad value raises: ConfigError, a subclass naming where the value came from, or the
    # user error of the code that owns the section (the launcher's LauncherError).
    ERROR: ClassVar[type[UserError]] = ConfigError

    @classmethod
    def key_of(cls, name: str) -> str:
        """The key of field `name` as the user writes it, in every message (`section.name`)."""
        return f"{cls.SECTION}.{name}"

    @classmethod
    def knobs(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)  # type: ignore[arg-type]  # every Section is a dataclass

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each knob's default by name (a required knob has none)."""
        found = {}
        for f in cls.knobs():
            if f.default is not dataclasses.MISSING:
                found[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                found[f.name] = f.default_factory()
        return found

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]  # every Section is one

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in self.knobs():
            value = _field_value(
                self.key_of(f.name), getattr(self, f.name), hints[f.name], f.metadata, self.ERROR
            )
            object.__setattr__(self, f.name, value)


class Entry:
    """An item of a list knob (each of eval.suites): a mapping of knobs, checked like a section
    but named by its place (`eval.suites[1].kind`). `check(key)` holds the checks across keys."""

    @classmethod
    def build(cls, key: str, value: Any) -> Any:
        if isinstance(value, cls):
            return value
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if not isinstance(value, dict):
            raise ConfigError(
                f"{key}: got {short_repr(value)}; must be a mapping of {', '.join(fields)}"
            )
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
                name: _field_value(
                    f"{key}.{name}", item, hints[name], fields[name].metadata, ConfigError
                )
                for name, item in value.items()
            }
        )
        entry.check(key)
        return entry

    def check(self, key: str) -> None:
        """Checks across this entry's keys; ConfigError naming `key.name`."""


def _field_value(key: str, value: Any, hint: Any, limits: Any, error: type[UserError]) -> Any:
    value = _check_value(key, value, hint, limits, error)
    if limits.get("path"):
        check_path(key, value, error)
    if "check" in limits:
        value = limits["check"](key, value)
    return value


def _check_value(key: str, value: Any, hint: Any, limits: Any, error: type[UserError]) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, Entry):
        return hint.build(key, value)
    if origin is Union or origin is types.UnionType:  # Optional[X] and X | None alike
        if value is None:
            if type(None) in args:
                return None
            raise error(f"{key}: must be set; null is not allowed")
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _check_value(key, value, option, limits, error)
            except error as exc:
                errors.append(str(exc).split("; ", 1)[-1])
        raise error(f"{key}: got {short_repr(value)}; " + "; or ".join(errors))
    if origin is list:
        if not isinstance(value, list):
            raise error(f"{key}: got {short_repr(value)}; must be a list, e.g. [a, b]")
        return [
            _check_value(f"{key}[{i}]", item, args[0], {}, error) for i, item in enumerate(value)
        ]
    if origin is tuple and args[1:] == (Ellipsis,):  # tuple[X, ...]: a frozen section's list
        if not isinstance(value, (list, tuple)):
            raise error(f"{key}: got {short_repr(value)}; must be a list, e.g. [a, b]")
        return tuple(
            _check_value(f"{key}[{i}]", item, args[0], {}, error) for i, item in enumerate(value)
        )
    if origin is Literal:
        if value not in args:
            raise error(f"{key}: got {short_repr(value)}; allowed: {', '.join(map(str, args))}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise error(f"{key}: got {short_repr(value)}; must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise error(f"{key}: got {short_repr(value)}; must be an integer{_range_text(limits)}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{key}: got {short_repr(value)}; must be a number{_range_text(limits)}")
        value = float(value)
        if not math.isfinite(value):
            raise error(
                f"{key}: got {short_repr(value)}; must be a finite number{_range_text(limits)}"
            )
    elif hint is str:
        if not isinstance(value, str):
            raise error(f"{key}: got {short_repr(value)}; must be a string")
        if limits.get("nonempty") and not value.strip():
            raise error(f"{key}: must not be empty")
        return value
    elif hint is Path:
        if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
            raise error(f"{key}: got {short_repr(value)}; must be a path")
        return Path(value)
    else:  # pragma: no cover - a field type this loader does not know is a programming error
        raise TypeError(f"{key}: unsupported field type {hint}")
    _check_range(key, value, limits, error)
    return value


def _check_range(key: str, value: float, limits: Any, error: type[UserError]) -> None:
    bad = (
        ("ge" in limits and value < limits["ge"])
        or ("gt" in limits and value <= limits["gt"])
        or ("le" in limits and value > limits["le"])
        or ("lt" in limits and value >= limits["lt"])
    )
    if bad:
        raise error(f"{key}: got {short_repr(value)}; must be{_range_text(limits)}")


def _range_text(limits: Any) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{words[k]} {limits[k]}" for k in words if k in limits]
    return (" " + " and ".join(parts)) if parts else ""


# The longest name (a part of a path between slashes) Linux's file systems take (NAME_MAX of ext4,
# xfs, btrfs, tmpfs), and the longest path the kernel takes (PATH_MAX, less its NUL).
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4095
# What a path knob's value may start with before its path: a model spec (`local-dir:PATH`).
PATH_PREFIXES = ("local-dir:", "chinese-clip:", "hf-hub:")


def path_problem(path: str) -> str | None:
    """Why the OS would refuse `path` at its first use (a name over NAME_MAX_BYTES, the whole over
    PATH_MAX_BYTES, a NUL byte: a traceback from deep inside a stage), or None. An fsspec URL
    (`s3://...`) is its store's to judge."""
    if "://" in path:
        return None
    for prefix in PATH_PREFIXES:
        path = path.removeprefix(prefix)
    shown = short_repr(path, 60)
    if "\0" in path:
        return f"{shown} holds a NUL byte"
    raw = path.encode("utf-8", "surrogateescape")
    if len(raw) > PATH_MAX_BYTES:
        return f"{shown} is {len(raw)} bytes long; the OS takes paths of at most {PATH_MAX_BYTES}"
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX_BYTES:
        name = short_repr(longest.decode("utf-8", "replace"), 60)
        return (
            f"the name {name} in it is {len(longest)} bytes long; file systems take names of at "
            f"most {NAME_MAX_BYTES} bytes"
        )
    return None


def check_path(key: str, value: Any, error: type[UserError] = ConfigError) -> Any:
    """`value` (a path, a list of paths, or None) when the OS can take each path; `error` naming
    `key` and the path otherwise. The one rule for every path a user names: path knobs, and the
    stages' path options."""
    for path in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(path, (str, os.PathLike)):
            problem = path_problem(str(path))
            if problem:
                raise error(f"{key}: {problem}")
    return value
