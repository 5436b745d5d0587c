"""Retrieval samples in TensorBoard at every validation: a grid of what a few fixed validation
captions retrieve (the correct images framed green) and the image-to-text direction as text."""

from __future__ import annotations

import io
import re
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from clipforge.train import retrieval_grid

pytestmark = pytest.mark.slow
READABLE_PIXELS = 11  # text at a normal reading size on screen


def _events(reference_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log_dir,) = (reference_run / "logs").iterdir()
    return EventAccumulator(str(log_dir), size_guidance={"images": 0, "tensors": 0}).Reload()


def _text(events, tag: str, step: int) -> str:
    (event,) = [e for e in events.Tensors(f"{tag}/text_summary") if e.step == step]
    return event.tensor_proto.string_val[0].decode("utf-8")


def _first_val_captions(small_data, count: int) -> list[str]:
    """Read straight from the first validation shard, in its order."""
    (shard, *_) = sorted((small_data / "val").glob("*.tar"))
    with tarfile.open(shard) as tar:
        texts = [m for m in tar.getmembers() if m.name.endswith(".txt")]
        return [tar.extractfile(m).read().decode("utf-8") for m in texts[:count]]


def test_every_validation_logs_a_grid_of_the_same_queries(reference_run, small_data):
    """Validation ran at steps 6 and 12: a grid at each, a row per query (the first validation
    captions), a caption band over five framed images per row."""
    events = _events(reference_run)
    grids = events.Images("samples/text_to_image")
    assert [g.step for g in grids] == [6, 12]
    height = retrieval_grid.band_top(4) + retrieval_grid.LEGEND_PIXELS
    for grid in grids:
        image = Image.open(io.BytesIO(grid.encoded_image_string))
        assert image.size == (5 * retrieval_grid.CELL_PIXELS, height)
    captions = _first_val_captions(small_data, 4)
    table = _text(events, "samples/text_to_image_queries", 12)
    assert [row.split(" | ")[1] for row in table.splitlines()[2:]] == captions


def test_the_correct_images_are_framed_green_where_the_text_says_they_rank(reference_run):
    """For each query, the first green frame of its row is at the rank the text gives for its
    first correct image (or there is none, when the text says it is not in the top 5)."""
    events = _events(reference_run)
    grid = events.Images("samples/text_to_image")[-1]
    pixels = np.asarray(Image.open(io.BytesIO(grid.encoded_image_string)).convert("RGB"))
    cell = retrieval_grid.CELL_PIXELS
    table = _text(events, "samples/text_to_image_queries", 12).splitlines()[2:]
    for row, line in enumerate(table):
        top = retrieval_grid.row_top(row)
        frames = [tuple(pixels[top + 1, column * cell + 1]) for column in range(5)]
        assert set(frames) <= {retrieval_grid.CORRECT, retrieval_grid.OTHER}, frames
        green = [rank for rank, colour in enumerate(frames, 1) if colour == retrieval_grid.CORRECT]
        stated = line.split(" | ")[2].rstrip(" |")
        assert stated == (str(green[0]) if green else "not in the top 5"), (line, frames)


def test_image_to_text_marks_exactly_the_images_own_caption(reference_run):
    """Each query image's top five captions: ✓ on those equal to its own caption, ✗ on others."""
    text = _text(_events(reference_run), "samples/image_to_text", 12)
    blocks = text.split("**image q")[1:]
    assert len(blocks) == 4
    for block in blocks:
        own = re.search(r"\(its caption: (.*)\)\*\*|\(its caption: (.*)\)", block)
        caption = own.group(1) or own.group(2)
        items = re.findall(r"^\d\. ([✓✗]) (.*)$", block, re.MULTILINE)
        assert len(items) == 5
        assert all((mark == "✓") == (found == caption) for mark, found in items), block


@pytest.fixture
def gallery(small_data):
    from clipforge.model.config import ModelConfig
    from clipforge.model.factory import build_model
    from clipforge.train.loader import uint8_transform

    bundle = build_model(ModelConfig(image_size=32))
    transform = uint8_transform(bundle.preprocess_val)[0]
    return retrieval_grid.load_gallery(small_data, transform, bundle.tokenizer)


def _frames(grid: np.ndarray, rows: int = 4) -> list[list[tuple]]:
    cell = retrieval_grid.CELL_PIXELS
    return [
        [tuple(grid[retrieval_grid.row_top(row) + 1, c * cell + 1]) for c in range(5)]
        for row in range(rows)
    ]


def test_a_query_finding_its_own_image_has_it_framed_green_at_that_rank(gallery):
    """Rankings where query 1 finds its own image (gallery index 0) second and query 2 never:
    the frame at row 1, column 2 is green, and the text gives rank 2 and `not in the top 5`."""
    others = [i for i, c in enumerate(gallery.captions) if c not in gallery.captions[:4]][:5]
    found = torch.tensor([[others[0], 0, *others[1:4]], others, others, others])
    grid, texts = retrieval_grid.render(gallery, found, found)
    frames = _frames(grid)
    assert frames[0] == [retrieval_grid.OTHER, retrieval_grid.CORRECT, *[retrieval_grid.OTHER] * 3]
    assert all(colour == retrieval_grid.OTHER for row in frames[1:] for colour in row)
    table = texts["samples/text_to_image_queries"].splitlines()[2:]
    assert table[0].endswith("| 2 |") and table[1].endswith("| not in the top 5 |")


def test_the_caption_is_drawn_with_a_cjk_font_or_given_in_the_text(gallery, monkeypatch):
    """With a CJK font (make test installs fonts-wqy-microhei) the caption band over each row has
    the caption's strokes; without one it holds only the label q1..., the captions being in the
    text. The grid is as wide either way."""
    found = torch.arange(5).repeat(4, 1)

    def band_ink(grid: np.ndarray, row: int) -> int:
        band = grid[retrieval_grid.band_top(row) : retrieval_grid.row_top(row)]
        return int((band < 128).any(axis=2).sum())

    if retrieval_grid.cjk_font():
        grid, _ = retrieval_grid.render(gallery, found, found)
        assert all(band_ink(grid, row) > 200 for row in range(4))  # strokes of the characters
    monkeypatch.setattr(retrieval_grid, "CJK_FONTS", ())
    retrieval_grid.cjk_font.cache_clear()
    try:
        grid, texts = retrieval_grid.render(gallery, found, found)
    finally:
        retrieval_grid.cjk_font.cache_clear()
    assert grid.shape[1] == 5 * retrieval_grid.CELL_PIXELS
    assert all(0 < band_ink(grid, row) < 200 for row in range(4))  # q1, q2...
    assert gallery.captions[0] in texts["samples/text_to_image_queries"]


@pytest.mark.parametrize("cjk", [True, False], ids=["cjk-font", "no-cjk-font"])
def test_the_grid_has_a_header_over_each_rank_column_and_a_legend_of_the_frames(
    gallery, monkeypatch, cjk
):
    """Above the rows, ink over each of the five rank columns (their labels); under them, a green
    and a grey swatch, each followed by ink (what it means). With or without a CJK font: the
    labels are Latin, in Pillow's own font."""
    if cjk and not retrieval_grid.cjk_font():
        pytest.skip("no CJK font on this machine (scripts/setup-system.sh fonts-wqy-microhei)")
    if not cjk:
        monkeypatch.setattr(retrieval_grid, "CJK_FONTS", ())
    retrieval_grid.cjk_font.cache_clear()
    try:
        grid, _ = retrieval_grid.render(
            gallery, torch.arange(5).repeat(4, 1), torch.zeros(4, 5, dtype=torch.long)
        )
    finally:
        retrieval_grid.cjk_font.cache_clear()
    cell = retrieval_grid.CELL_PIXELS
    ink = (grid < 100).all(axis=2)  # black text (the frames and thumbnails are not in the bands)
    header = ink[: retrieval_grid.HEADER_PIXELS]
    for column in range(5):
        left = column * cell
        assert header[:, left : left + cell].sum() > 20, f"no label over rank column {column + 1}"
    legend_top = retrieval_grid.band_top(4)
    assert grid.shape[0] == legend_top + retrieval_grid.LEGEND_PIXELS
    legend = grid[legend_top:]
    for colour in (retrieval_grid.CORRECT, retrieval_grid.OTHER):
        where = np.argwhere((legend == colour).all(axis=2))
        assert len(where) >= retrieval_grid.SWATCH_PIXELS**2, f"no {colour} swatch in the legend"
        right_of_swatch = ink[legend_top:, where[:, 1].max() + 1 :][:, :40]
        assert right_of_swatch.sum() > 20, f"no words after the {colour} swatch"


def test_the_logged_grid_reads_at_the_width_tensorboard_shows_it(reference_run):
    """TensorBoard's image card shows an image CARD_PIXELS wide (a wider one shrunk to that, its
    text with it). The grid the run logged, so scaled, keeps its labels' font at 11 pixels or
    more, and its captions' ink (a line of CJK characters, as drawn) 11 pixels high or more."""
    grid = _events(reference_run).Images("samples/text_to_image")[-1]
    pixels = np.asarray(Image.open(io.BytesIO(grid.encoded_image_string)).convert("RGB"))
    scale = min(1.0, retrieval_grid.CARD_PIXELS / pixels.shape[1])
    assert retrieval_grid._label_font().size * scale >= READABLE_PIXELS
    font = retrieval_grid.cjk_font()
    if font is None:
        pytest.skip("no CJK font on this machine (scripts/setup-system.sh fonts-wqy-microhei)")
    assert font.size * scale >= READABLE_PIXELS
    for row in range(4):
        band = pixels[retrieval_grid.band_top(row) : retrieval_grid.row_top(row)]
        inked = np.flatnonzero((band < 128).all(axis=2).any(axis=1))  # rows with a stroke
        assert _first_run(inked) * scale >= READABLE_PIXELS, (row, inked)


def _first_run(numbers: np.ndarray) -> int:
    """How many of the sorted numbers come one after another from the first (a line's rows)."""
    gaps = np.flatnonzero(np.diff(numbers) > 1)
    return int(gaps[0] + 1) if len(gaps) else len(numbers)
