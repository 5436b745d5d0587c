#!/usr/bin/env python3
"""params.yaml's knob docs, from the typed config (the one source of each knob's doc).

  python scripts/params_section.py SECTION   print a section rendered from the typed config:
                                             defaults with their docs as comments (when adding
                                             knobs: paste the keys you added)
  python scripts/params_section.py --write   rewrite the comment above every key of params.yaml
                                             as its knob's doc (after editing a doc in a section:
                                             data/, model/, train/, eval/, alerts/ or store/
                                             config.py; or a recipe in clipforge/recipes.py)

tests/unit/test_config.py fails while params.yaml's comments differ from what --write writes.
"""

import re
import sys
import textwrap
from pathlib import Path

import yaml

from clipforge.pipeline.params import PipelineParams, field_docs

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
WIDTH = 100
_KEY = re.compile(r"^( *)([A-Za-z_][A-Za-z0-9_]*):")


def doc_comment(doc: str, indent: str) -> list[str]:
    """A knob's doc as params.yaml comment lines, at most WIDTH columns (ids are never split)."""
    prefix = f"{indent}# "
    lines = textwrap.wrap(doc, WIDTH - len(prefix), break_on_hyphens=False, break_long_words=False)
    return [prefix + line for line in lines]


def render_section(section: str) -> str:
    docs = field_docs()
    values = PipelineParams().to_dict()[section]
    lines = [f"{section}:"]
    for key, value in values.items():
        lines += doc_comment(docs[f"{section}.{key}"], "  ")
        lines.append(
            "  "
            + yaml.safe_dump({key: value}, allow_unicode=True, default_flow_style=True).strip()[
                1:-1
            ]
        )
    return "\n".join(lines)


def documented(text: str) -> str:
    """params.yaml text with the comment block right above each knob replaced by its doc; other
    lines (values, section headings, blank lines) as they were."""
    docs = field_docs()
    out: list[str] = []
    section = None
    for line in text.splitlines():
        match = _KEY.match(line)
        if match:
            indent, name = match.groups()
            if not indent:
                section = name
            dotted = name if not indent else f"{section}.{name}" if indent == "  " else None
            if dotted in docs:
                while out and out[-1].startswith(f"{indent}#"):
                    out.pop()
                out += doc_comment(docs[dotted], indent)
        out.append(line)
    return "\n".join(out) + "\n"


def doc_problems(text: str) -> list[str]:
    """One line per knob the schema has and params.yaml does not show in its own section, or shows
    without its doc as the comment right above it."""
    comments: dict[str, list[str]] = {}
    lines = text.splitlines()
    section = None
    for index, line in enumerate(lines):
        match = _KEY.match(line)
        if not match:
            continue
        indent, name = match.groups()
        if not indent:
            section = name
        dotted = name if not indent else f"{section}.{name}" if indent == "  " else None
        above = index
        while above and lines[above - 1].startswith(f"{indent}#"):
            above -= 1
        comments.setdefault(dotted, lines[above:index])
    problems = []
    for dotted, doc in field_docs().items():
        if dotted not in comments:
            problems.append(f"{dotted}: missing from params.yaml")
        elif comments[dotted] != doc_comment(doc, "  " if "." in dotted else ""):
            problems.append(
                f"{dotted}: the comment above it is not its doc; "
                f"run python scripts/params_section.py --write"
            )
    return problems


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        PARAMS.write_text(documented(PARAMS.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(render_section(sys.argv[1]))
