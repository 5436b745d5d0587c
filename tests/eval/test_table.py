"""The eval stage's table on screen: within the terminal's width, every number kept."""

from __future__ import annotations

import re

import pytest

from clipforge.eval.stage import COLUMNS, MEAN_KEY, format_table


def _metrics() -> dict:
    """Two suites (retrieval, classification) with a baseline and the deltas: the widest table."""
    model = {
        "flickr30k-cn-test": {
            k: 10.0 + i for i, k in enumerate(COLUMNS) if not k.startswith("top")
        },
        "colour-shape": {"top1": 61.25, "top5": 97.5},
        MEAN_KEY: 41.5,
    }
    baseline = {
        "flickr30k-cn-test": {k: 1.0 + i for i, k in enumerate(COLUMNS) if not k.startswith("top")},
        "colour-shape": {"top1": 20.0, "top5": 50.0},
        MEAN_KEY: 11.5,
    }
    delta = {
        name: {k: v - baseline[name][k] for k, v in value.items()}
        for name, value in model.items()
        if isinstance(value, dict)
    }
    return {**model, "baseline": baseline, "delta": {**delta, MEAN_KEY: 30.0}}


@pytest.mark.parametrize("width", [80, 60])
def test_the_table_fits_the_terminal_and_keeps_every_number(width):
    table = format_table(_metrics(), width)
    assert max(len(line) for line in table.splitlines()) <= width, table
    for number in ("10.00", "16.00", "61.25", "97.50", "41.50", "+9.00", "+30.00", "+47.50"):
        assert number in table, (number, table)
    for metric in COLUMNS:  # each metric's column, in a block that names its suites
        assert metric in table
    blocks = table.split("\n\n")
    assert all(re.search(r"^colour-shape +delta ", block, re.M) for block in blocks), table


def test_a_wide_terminal_gets_one_block():
    table = format_table(_metrics(), 200)
    assert "\n\n" not in table
    assert all(metric in table.splitlines()[0] for metric in COLUMNS)
