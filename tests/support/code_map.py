"""The map of src/clipforge in docs/development.md: every package and module with the first line
of its docstring, read from the source (nothing imported). The docstring is where a module says
what it is; the map is written from it, so it cannot go stale (tests/test_code_map.py).

`python -m tests.support.code_map` writes the table into docs/development.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "development.md"
PACKAGE = REPO / "src" / "clipforge"
HEADING = "## The map of src/clipforge"
HEADER = ["| module | what it is |", "| --- | --- |"]


def summary(path: Path) -> str | None:
    """The first line of a module's docstring; None without one."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return doc.strip().splitlines()[0] if doc and doc.strip() else None


def modules(package: Path) -> list[Path]:
    """A package's `__init__.py`, then its modules, then its subpackages' in turn, each sorted."""
    found = [package / "__init__.py"]
    found += sorted(p for p in package.glob("*.py") if p.name != "__init__.py")
    for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").is_file()):
        found += modules(sub)
    return found


def name_of(path: Path, root: Path) -> str:
    """`clipforge/store/` for a package, `clipforge/store/remote.py` for a module."""
    relative = path.relative_to(root).as_posix()
    return relative.removesuffix("__init__.py") if path.name == "__init__.py" else relative


def summary_problems(package: Path) -> list[str]:
    """One line per module the map cannot show: no docstring, or a first line that is not a
    sentence of its own (it must end in `.` or `?`)."""
    problems = []
    for path in modules(package):
        line = summary(path)
        if line is None:
            problems.append(f"{name_of(path, package.parent)}: no docstring")
        elif not line.endswith((".", "?")):
            problems.append(f"{name_of(path, package.parent)}: its first line is not a sentence")
    return problems


def map_rows(package: Path = PACKAGE) -> list[str]:
    """The table: a header, its rule, one row per package and module."""
    rows = list(HEADER)
    for path in modules(package):
        text = (summary(path) or "").replace("|", "\\|")
        rows.append(f"| `{name_of(path, package.parent)}` | {text} |")
    return rows


def write(doc: Path = DOC) -> None:
    """Replace the table under HEADING in `doc` with map_rows()."""
    before, after = doc.read_text(encoding="utf-8").split(f"\n{HEADING}\n", 1)
    lines = after.split("\n")
    start = lines.index(HEADER[0])
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    lines[start:end] = map_rows()
    doc.write_text(f"{before}\n{HEADING}\n" + "\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    write()
