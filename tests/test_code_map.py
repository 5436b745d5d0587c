"""docs/development.md's map of src/clipforge is the packages' and modules' docstrings: every one
listed with its docstring's first line, in the order of the tree (tests.support.code_map)."""

from __future__ import annotations

from tests.support.code_map import DOC, HEADING, PACKAGE, map_rows, summary_problems, write
from tests.support.doc_tables import table_in_order, table_problems


def test_the_map_is_the_docstrings():
    text = DOC.read_text(encoding="utf-8")
    assert table_problems(text, HEADING, map_rows()) == []
    assert table_in_order(text, map_rows())


def test_every_module_says_what_it_is_in_one_line():
    """The map shows a docstring's first line: each module has one, a sentence of its own."""
    assert summary_problems(PACKAGE) == []


def test_a_new_module_a_changed_docstring_and_a_gone_module_are_named(tmp_path):
    """On a package made for it: a module the doc lacks, a row whose docstring changed and a row
    of a module that is gone are each named; a module without a docstring, or whose first line
    runs on, is named too."""
    package = tmp_path / "clipforge"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text('"""The package."""\n')
    (package / "sub" / "__init__.py").write_text('"""A subpackage."""\n')
    (package / "kept.py").write_text('"""Kept as it was."""\n')
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Doc\n\n{HEADING}\n\n| module | what it is |\n| --- | --- |\n\nafter\n")
    rows = map_rows(package)
    doc.write_text(doc.read_text().replace("| --- | --- |\n", "\n".join(rows[1:]) + "\n"))
    assert table_problems(doc.read_text(), HEADING, rows) == []

    (package / "kept.py").write_text('"""Kept, but said anew."""\n')
    (package / "new.py").write_text("x = 1\n")
    (package / "sub" / "gone.py").write_text('"""Here a moment."""\n')
    text = doc.read_text().replace(
        "| `clipforge/sub/` | A subpackage. |",
        "| `clipforge/sub/` | A subpackage. |\n| `clipforge/sub/old.py` | Gone. |",
    )
    assert [line.split(":")[0] for line in table_problems(text, HEADING, map_rows(package))] == [
        "clipforge/kept.py",
        "clipforge/new.py",
        "clipforge/sub/gone.py",
        "clipforge/sub/old.py",
    ]
    (package / "sub" / "gone.py").write_text('"""Runs on\npast its first line."""\n')
    assert summary_problems(package) == [
        "clipforge/new.py: no docstring",
        "clipforge/sub/gone.py: its first line is not a sentence",
    ]


def test_writing_the_map_makes_the_doc_pass(tmp_path):
    """`python -m tests.support.code_map` writes the table in place, the text around it kept."""
    doc = tmp_path / "development.md"
    table = "| module | what it is |\n| --- | --- |\n| x | y |\n"
    doc.write_text(f"before\n{HEADING}\n\nintro\n\n{table}\n## After\n")
    write(doc)
    text = doc.read_text()
    assert table_problems(text, HEADING, map_rows()) == [] and table_in_order(text, map_rows())
    assert text.startswith(f"before\n{HEADING}\n\nintro\n\n") and text.endswith("\n\n## After\n")
