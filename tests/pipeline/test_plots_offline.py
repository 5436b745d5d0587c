"""`dvc plots show`'s page draws its charts with no network, in a real browser (Debian's headless
Chromium, a fresh profile, every host name unresolvable), and the charts say something: one colour
per series with a legend, axis titles, the x-axis from step 0, validation as points.

The curves are metrics files as the train stage writes them (a few rows each), in a DVC repository
with the project's dvc.yaml and .dvc/ (config, templates): no training needed to draw them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, git

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (scripts/setup-system.sh chromium)"
)
CHARTS = ("loss", "val_recall", "learning_rate", "throughput")


def _write_metrics(root: Path) -> None:
    metrics = root / "metrics"
    metrics.mkdir()
    train = ["step\tloss\tlr\tsamples_per_s\trun_id"]
    train += [
        f"{s}\t{4 - s / 40:.3f}\t{1e-3 * (1 - s / 100):.6f}\t{300 + s}\trun-x"
        for s in range(10, 100, 10)
    ]
    val = ["step\tloss\tt2i_r01\ti2t_r01\tmean_recall\trun_id"]
    val += [
        f"{s}\t{3.5 - s / 50:.3f}\t{s / 10:.2f}\t{s / 9:.2f}\t{s / 3:.2f}\trun-x"
        for s in (20, 40, 60, 80, 93)
    ]
    (metrics / "train.tsv").write_text("\n".join(train) + "\n")
    (metrics / "val.tsv").write_text("\n".join(val) + "\n")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plots")
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    shutil.copytree(REPO / ".dvc", root / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"))
    _write_metrics(root)
    git(root, "init", "--quiet")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = root / "dvc_plots"
    done = subprocess.run(
        ["dvc", "plots", "show", "--out", str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out / "index.html"


def _chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium as Debian ships it, offline: no background traffic, and every host name
    resolves to nothing (a CDN script would not load)."""
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--virtual-time-budget=20000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _specs(html: str) -> dict[str, dict]:
    """The Vega-Lite spec of each chart, by its name, as DVC embedded it in the page."""
    found = {}
    pattern = r"var spec = (\{.*?\});\s*vegaEmbed\('#([^']+)', spec\)"
    for spec, name in re.findall(pattern, html, re.S):
        found[name] = json.loads(spec)
    return found


def test_the_page_needs_no_network(page):
    """Every script is inside the page: none names a URL to load."""
    html = page.read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]+src=", html)
    assert "window.vegaEmbed" in html


def test_each_chart_has_a_legend_axis_titles_and_starts_at_step_0(page):
    specs = _specs(page.read_text(encoding="utf-8"))
    assert set(CHARTS) <= set(specs), list(specs)
    for name in CHARTS:
        encoding = specs[name]["encoding"]
        assert encoding["x"]["title"] == "optimizer step" and encoding["x"]["scale"]["zero"]
        assert encoding["y"]["title"] and encoding["y"]["title"] != "y"
        assert encoding["color"]["field"] == "series" and "legend" in encoding["color"]
        assert specs[name]["mark"]["point"]
    # a series per file (train and val loss) and per field (the three recalls), per revision
    (loss,) = specs["loss"]["transform"]
    (recall,) = specs["val_recall"]["transform"]
    assert "datum.filename" in loss["calculate"] and "datum.field" in recall["calculate"]


def test_chromium_draws_every_chart_offline_in_distinct_colours(page, tmp_path):
    """The DOM after the scripts ran holds a drawn canvas per chart; the screenshot holds the
    curves, in more than one colour (train and validation loss differ)."""
    dom = _chromium(tmp_path / "profile-dom", "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count('class="marks"') >= len(CHARTS), dom.stdout[-2000:]

    shot = tmp_path / "page.png"
    taken = _chromium(
        tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1200,2200", page.as_uri()
    )
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3).astype(int)
    # saturated: the marks, not the text, axes or grid (greys)
    coloured = [tuple(p) for p in pixels if p.max() - p.min() > 80]
    assert len(coloured) > 2000, len(coloured)
    hues = {_hue_bucket(p) for p in coloured}
    assert len(hues) >= 3, hues  # vega's category colours: blue, orange, red...


def _hue_bucket(rgb: tuple[int, int, int]) -> int:
    import colorsys

    hue, _, _ = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    return int(hue * 12)
