#!/usr/bin/env python3
"""Print a params.yaml section rendered from the typed config: defaults with their docs as comments.

Use when adding knobs: `python scripts/params_section.py alerts` and paste the keys you added.
"""

import sys
import textwrap

import yaml

from clipforge.config import Config, field_docs


def render_section(section: str) -> str:
    docs = field_docs()
    values = Config().to_dict()[section]
    lines = [f"{section}:"]
    for key, value in values.items():
        lines += ["  # " + line for line in textwrap.wrap(docs[f"{section}.{key}"], 96)]
        lines.append(
            "  "
            + yaml.safe_dump({key: value}, allow_unicode=True, default_flow_style=True).strip()[
                1:-1
            ]
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_section(sys.argv[1]))
