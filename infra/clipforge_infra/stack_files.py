"""Reading Pulumi.yaml's config declarations and a stack's Pulumi.<stack>.yaml without the CLI.

`make up` needs a few answers before it calls Pulumi (which cluster context? does the stack pin an
image? is the SSH key set?), and the tests need the config exactly as the CLI would hand it to the
program: stack value if set, else the declared default, primitives as text, arrays as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clipforge.errors import UserError
from clipforge.yamlfile import read_yaml_file

from .contract import PROJECT

_NO_DEFAULT = object()


class StackFileError(UserError, ValueError):
    """A missing Pulumi.<stack>.yaml, or one that is no mapping (a YAML mistake is the reader's
    YamlFileError, FILE:LINE:COLUMN)."""


@dataclass(frozen=True)
class ConfigDeclaration:
    key: str
    type: str
    description: str
    default: Any  # _NO_DEFAULT when the key has none

    @property
    def has_default(self) -> bool:
        return self.default is not _NO_DEFAULT


def load_declarations(project_dir: Path) -> dict[str, ConfigDeclaration]:
    project = _mapping(project_dir / "Pulumi.yaml")
    return {
        key: ConfigDeclaration(
            key=key,
            type=spec["type"],
            description=spec.get("description", ""),
            default=spec.get("default", _NO_DEFAULT),
        )
        for key, spec in (project.get("config") or {}).items()
    }


def stack_file(project_dir: Path, stack: str) -> Path:
    return project_dir / f"Pulumi.{stack}.yaml"


def available_stacks(project_dir: Path) -> list[str]:
    return sorted(
        path.name[len("Pulumi.") : -len(".yaml")] for path in project_dir.glob("Pulumi.*.yaml")
    )


def load_stack_values(project_dir: Path, stack: str) -> dict[str, Any]:
    """This project's keys set in the stack file (prefix stripped); secrets stay ``{"secure": ...}``."""
    path = stack_file(project_dir, stack)
    if not path.is_file():
        stacks = ", ".join(available_stacks(project_dir)) or "none"
        raise StackFileError(
            f"no stack file {path}: copy an example (stacks here: {stacks}) to "
            f"Pulumi.{stack}.yaml and edit it"
        )
    config = _mapping(path).get("config") or {}
    if not isinstance(config, dict):
        raise StackFileError(f"{path}: `config` must be a mapping of {PROJECT}:KEY: value")
    prefix = f"{PROJECT}:"
    return {key[len(prefix) :]: value for key, value in config.items() if key.startswith(prefix)}


def _mapping(path: Path) -> dict:
    """A YAML file's top-level mapping; YamlFileError (FILE:LINE:COLUMN) when it is not YAML,
    StackFileError when it is not a mapping: both user errors."""
    document = read_yaml_file(path)
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise StackFileError(f"{path}: not a YAML mapping")
    return document


def is_secure(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"secure"}


def undeclared_keys(
    declarations: Mapping[str, ConfigDeclaration], stack_values: Mapping[str, Any]
) -> list[str]:
    """Keys the stack sets that Pulumi.yaml does not declare: typos that would be silently ignored."""
    return sorted(set(stack_values) - set(declarations))


def as_program_value(value: Any) -> str:
    """A config value as the program receives it from the CLI: text, arrays and maps as JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def program_config(
    declarations: Mapping[str, ConfigDeclaration], stack_values: Mapping[str, Any]
) -> dict[str, str | None]:
    """Key -> value the program would see: the stack's value, else the default, else None (unset)."""
    config: dict[str, str | None] = {}
    for key, declaration in declarations.items():
        if key in stack_values:
            config[key] = as_program_value(stack_values[key])
        elif declaration.has_default:
            config[key] = as_program_value(declaration.default)
        else:
            config[key] = None
    return config
