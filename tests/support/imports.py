"""The clipforge modules a module imports, read from its source with `ast` (nothing imported):
one reader for the DVC deps check and the package layers check."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

SRC = REPO / "src"


def module_file(name: str) -> Path | None:
    """The file of module or package `name` under src/, None when there is none."""
    base = SRC.joinpath(*name.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def package_of(module: str) -> str:
    """The innermost package holding `module` (a package holds itself)."""
    path = module_file(module)
    assert path is not None, module
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_modules(module: str) -> set[str]:
    """The clipforge modules `module` imports, anywhere in its body (`from pkg import module`
    counts the module)."""
    path = module_file(module)
    assert path is not None, module
    package = package_of(module)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}".rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] == "clipforge" and module_file(m)}
