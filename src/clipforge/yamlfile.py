"""The one loader of the YAML files users hand the project.

The YAML files users hand the project (params.yaml, Pulumi stack files, fabric.yaml): one loader,
so a broken file is one line `FILE:LINE:COLUMN: reason` wherever it is read.

The loader reads `1e-4` as a float, as YAML 1.2 (and DVC's ruamel) do, not as a string. It refuses a
key given twice in one mapping: PyYAML would silently keep the last one, so a second `train:`
section would replace the first without a word (Pulumi's own YAML reader refuses them too). It
refuses aliases that expand a document past MAX_EXPANDED_VALUES values, or into itself: PyYAML
shares an aliased value rather than copying it, but every reader that walks the value (a check, a
repr, a JSON dump) expands it, and nine nested lists of nine aliases (300 characters on `--set`)
expand to 387 million.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from clipforge.errors import UserError
from clipforge.util import short_repr


class YamlFileError(UserError, ValueError):
    """A YAML file that cannot be read or parsed; the message names the file (and line)."""


# Values (scalars, lists, mappings) a document may reach once its aliases are expanded, when that
# is more than it has written out: params.yaml has a few hundred.
MAX_EXPANDED_VALUES = 100_000


class _Loader(yaml.SafeLoader):
    def construct_document(self, node):
        sizes: dict[int, int] = {}
        cycle = _expand(node, sizes)
        written = _written_values(node)
        if cycle is not None or sizes[id(node)] > max(MAX_EXPANDED_VALUES, written):
            where = cycle or _where_it_grows(node, sizes)
            problem = (
                "an alias (*name) inside its own anchor expands without end"
                if cycle
                else f"aliases (*name) expand to {sizes[id(where)]:,} values, over the "
                f"{MAX_EXPANDED_VALUES:,} read"
            )
            raise yaml.constructor.ConstructorError(
                None, None, f"{problem}: write the values out", where.start_mark
            )
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {short_repr(key)} appears twice in one mapping (first on line "
                    f"{seen[key] + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _expand(root: yaml.Node, sizes: dict[int, int]) -> yaml.Node | None:
    """Fill `sizes` (id of a node -> the values it holds once every alias is expanded), counted
    without expanding, each node once; the node an alias inside itself names (no end), or None."""
    open_nodes: set[int] = set()  # on the path from the root: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
        elif id(node) in open_nodes:
            return node
        elif id(node) not in sizes:
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))
    return None


def _where_it_grows(node: yaml.Node, sizes: dict[int, int]) -> yaml.Node:
    """The innermost node still over the budget: where the aliases that blow up are."""
    while True:
        over = [c for c in _children(node) if sizes[id(c)] > MAX_EXPANDED_VALUES]
        if not over:
            return node
        node = over[0]


def _written_values(root: yaml.Node) -> int:
    """The distinct nodes of a document: what its text writes out, aliases counted once."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            stack.extend(_children(node))
    return len(seen)


def load_yaml(text: str) -> Any:
    """Parse YAML text; raises yaml.YAMLError (see `read_yaml_file` for the one-line form)."""
    return yaml.load(text, Loader=_Loader)


def read_yaml_file(path: str | Path) -> Any:
    """The parsed content of a YAML file (None when blank); YamlFileError naming the file, line
    and column."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise YamlFileError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise YamlFileError(
            f"{path}:{line}:{column}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the "
            f"file as UTF-8"
        ) from None
    if not text.strip():  # PyYAML trips over a blank file's tabs; blank is empty
        return None
    try:
        return load_yaml(text)
    except yaml.YAMLError as exc:
        raise YamlFileError(yaml_error_line(path, exc)) from None


def yaml_error_line(path: str | Path, exc: yaml.YAMLError) -> str:
    """`FILE:LINE:COLUMN: reason` of a parser error (lines and columns counted from 1)."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    context_mark = getattr(exc, "context_mark", None)
    if context and context_mark and (not mark or context_mark.line != mark.line):
        problem += f" ({context} on line {context_mark.line + 1})"
    elif context:
        problem += f" ({context})"
    return f"{where}: {problem}"
