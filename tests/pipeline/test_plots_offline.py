"""`dvc plots show`'s page draws its charts with no network, in a real browser (Debian's headless
Chromium, a fresh profile, every host name unresolvable), and the charts say something: one colour
per series with a legend, axis titles, the x-axis from step 0, validation as points; axis labels
as plain numbers, and a legend naming runs (and a run's curves), as drawn (SVG text in the DOM).

The curves are metrics files as the train stage writes them (a few rows each), in a DVC repository
with the project's dvc.yaml and .dvc/ (config, templates): no training needed to draw them.
`dvc plots diff` compares two experiments named as `fab fetch` and DVC name them.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from clipforge.repro.experiments import experiment_name
from tests.conftest import REPO, git

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (scripts/setup-system.sh chromium)"
)
CHARTS = ("loss", "val_recall", "learning_rate", "throughput")
# The two runs `dvc plots diff` compares: the demo's experiment (a name DVC made up) and a smoke
# run `fab fetch` brought home (named by its launch id).
RUNS = ("malar-eggs", experiment_name("20261201-101112-abcdef01", smoke=True))
PLAIN_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?")


def _write_metrics(root: Path, speed: float = 1.0) -> None:
    """Recall from about 10 to 50 % (the demo's range): Vega's ticks 10 apart, which `~g` drew
    as 1e+1 ... 5e+1."""
    metrics = root / "metrics"
    metrics.mkdir(exist_ok=True)
    train = ["step\tloss\tlr\tsamples_per_s\trun_id"]
    train += [
        f"{s}\t{4 - speed * s / 40:.3f}\t{1e-3 * (1 - s / 100):.6f}\t{300 + s}\trun-x"
        for s in range(10, 100, 10)
    ]
    val = ["step\tloss\tt2i_r01\ti2t_r01\tmean_recall\trun_id"]
    val += [
        f"{s}\t{3.5 - s / 50:.3f}\t{speed * s / 2:.2f}\t{s / 2.2:.2f}\t{s / 2.1:.2f}\trun-x"
        for s in (20, 40, 60, 80, 93)
    ]
    (metrics / "train.tsv").write_text("\n".join(train) + "\n")
    (metrics / "val.tsv").write_text("\n".join(val) + "\n")


def _dvc(root: Path, *args: str) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["DVC_NO_ANALYTICS"] = "1"
    done = subprocess.run(
        ["dvc", *args], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _project_plots(root: Path, dvc_yaml: dict) -> None:
    (root / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml, sort_keys=False))
    shutil.copytree(REPO / ".dvc", root / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"))
    git(root, "init", "--quiet")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plots")
    _project_plots(root, yaml.safe_load((REPO / "dvc.yaml").read_text()))
    _write_metrics(root)
    _dvc(root, "plots", "show", "--out", str(root / "dvc_plots"))
    return root / "dvc_plots" / "index.html"


@pytest.fixture(scope="module")
def diff_page(tmp_path_factory) -> Path:
    """`dvc plots diff` of two experiments: the project's charts (its stages left out, whose code
    an experiment would need), each run's curves saved with `dvc exp save`."""
    root = tmp_path_factory.mktemp("plots-diff")
    _project_plots(root, {"plots": yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"]})
    _write_metrics(root)
    for key, value in (("user.name", "test"), ("user.email", "test@example.org")):
        git(root, "config", key, value)
    git(root, "add", "--all")
    git(root, "commit", "--quiet", "-m", "charts")
    for speed, name in zip((1.0, 0.8), RUNS):
        _write_metrics(root, speed)
        _dvc(root, "exp", "save", "--name", name)
    _dvc(root, "plots", "diff", *RUNS, "--out", str(root / "dvc_plots"))
    return root / "dvc_plots" / "index.html"


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
    # DVC told to split a chart's files (train and val loss) and fields (the recalls) into series
    assert "datum.filename" in specs["loss"]["transform"][0]["calculate"]
    assert "datum.field" in specs["val_recall"]["transform"][0]["calculate"]


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


@dataclass
class DrawnChart:
    axes: dict[str, list[str]]  # each axis's labels, by its title
    legend: list[str]


def _drawn(dom: str) -> list[DrawnChart]:
    """What each chart shows as text, in page order: SVG (the template's renderer) keeps every
    axis label and legend entry as a <text> element, as Chromium laid it out."""
    charts = []
    for svg in dom.split('class="marks"')[1:]:  # a chart's <svg>; the others are menu icons
        axes = {}
        axis = r"role-axis\"[^>]*aria-label=\"[XY]-axis titled '([^']*)'.*?role-axis-label"
        for title, labels in re.findall(axis + r'"[^>]*>(.*?)</g>', svg, re.S):
            axes[html.unescape(title)] = _texts(labels)
        legend = re.findall(r'role-legend-label"[^>]*>(.*?)</g>', svg, re.S)
        charts.append(DrawnChart(axes, [text for group in legend for text in _texts(group)]))
    return charts


def _texts(svg: str) -> list[str]:
    return [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]


def _drawn_page(page: Path, profile: Path) -> dict[str, DrawnChart]:
    dom = _chromium(profile, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    charts = _drawn(dom.stdout)
    assert len(charts) == len(CHARTS), dom.stdout[-2000:]
    return dict(zip(CHARTS, charts))  # DVC draws them in dvc.yaml's order


def test_chromium_draws_plain_numbers_on_every_axis(page, diff_page, tmp_path):
    """Every tick label is a plain number (10, 20, 0.0005), recall's tens too (not 1e+1)."""
    for name, shown in (("show", page), ("diff", diff_page)):
        charts = _drawn_page(shown, tmp_path / f"profile-{name}")
        for chart, drawn in charts.items():
            assert set(drawn.axes) == {"optimizer step", _y_title(chart)}, drawn.axes
            for title, labels in drawn.axes.items():
                assert len(labels) >= 3, (chart, title, labels)
                odd = [label for label in labels if not PLAIN_NUMBER.fullmatch(label)]
                assert not odd, (chart, title, labels)
        recall = charts["val_recall"].axes["recall (%)"]
        assert {"10", "20", "30", "40"} <= set(recall), recall


def _y_title(chart: str) -> str:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"][CHARTS.index(chart)][chart][
        "y_label"
    ]


def test_the_legend_names_the_runs_and_their_curves(page, diff_page, tmp_path):
    """`dvc plots diff A B`: each series by its run's name (and its file or field where a run has
    several curves), not DVC's `rev::file`; `dvc plots show` (one run): by its curves, or by the
    run where it has one."""
    diff = _drawn_page(diff_page, tmp_path / "profile-diff")
    assert set(diff["learning_rate"].legend) == set(RUNS)
    assert set(diff["throughput"].legend) == set(RUNS)
    assert set(diff["loss"].legend) == {
        f"{run} {curve}" for run in RUNS for curve in ("train", "val")
    }
    recalls = ("t2i_r01", "i2t_r01", "mean_recall")
    assert set(diff["val_recall"].legend) == {f"{run} {field}" for run in RUNS for field in recalls}
    show = _drawn_page(page, tmp_path / "profile-show")
    assert set(show["loss"].legend) == {"train", "val"}
    assert set(show["val_recall"].legend) == set(recalls)
    assert show["learning_rate"].legend == ["workspace"]
