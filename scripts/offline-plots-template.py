#!/usr/bin/env python3
"""Write .dvc/plots/offline.html: the page `dvc plots show` fills, with Vega, Vega-Lite and
Vega-Embed inside it, so that the charts draw with no network (DVC's own page loads them from a
CDN: a blank page on a GPU box or behind a firewall). .dvc/config names it
(`plots.html_template`).

The libraries come from vl-convert-python, which bundles them. The page is committed, so
`dvc plots show` needs nothing installed, and only whoever refreshes the page needs that package
(no extra of the project holds it: nothing else uses it):
  .venv/bin/pip install vl-convert-python==1.9.0.post1
  .venv/bin/python scripts/offline-plots-template.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import vl_convert

TARGET = Path(__file__).resolve().parent.parent / ".dvc" / "plots" / "offline.html"
# The newest Vega-Lite 5 (the major version of DVC's templates and ours: $schema .../v5.json).
VEGA_LITE = "5.21"

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
    <!-- Vega, Vega-Lite and Vega-Embed (vl-convert-python VL_CONVERT): no network needed. -->
    <script>BUNDLE</script>
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def page() -> str:
    bundle = vl_convert.javascript_bundle(vl_version=VEGA_LITE)
    if "</script" in bundle:
        raise ValueError("the bundle holds `</script`: it cannot be inlined as it is")
    return PAGE.replace("VL_CONVERT", vl_convert.__version__).replace("BUNDLE", bundle)


def main() -> int:
    TARGET.write_text(page(), encoding="utf-8")
    print(f"wrote {TARGET} ({TARGET.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
