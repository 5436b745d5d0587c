"""Tables in the docs that are written from the code (the launcher's settings, the map of
src/clipforge): where a doc's table differs from the rows the code gives, one line per row."""

from __future__ import annotations


def table_problems(text: str, heading: str, rows: list[str]) -> list[str]:
    """One line per way the table under `heading` in `text` differs from `rows` (its header line,
    its rule, then one row per key, the key being the first cell): a key missing, a key not
    declared, a row that is not the declaration's."""
    lines = text.split(f"\n{heading}\n", 1)[1].splitlines()
    start = lines.index(rows[0]) + 2  # past the header and its rule
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    documented = {_key(row): row for row in lines[start:end]}
    declared = {_key(row): row for row in rows[2:]}
    problems = [f"{k}: declared, not in the table" for k in declared.keys() - documented.keys()]
    problems += [f"{k}: in the table, not declared" for k in documented.keys() - declared.keys()]
    problems += [
        f"{k}: the row is not the declaration's, which is: {declared[k]}"
        for k in declared.keys() & documented.keys()
        if documented[k] != declared[k]
    ]
    return sorted(problems)


def table_in_order(text: str, rows: list[str]) -> bool:
    """Whether `text` holds the table exactly, rows in the declarations' order."""
    return "\n".join(rows) in text


def _key(row: str) -> str:
    return row.split("|")[1].strip().strip("`")
