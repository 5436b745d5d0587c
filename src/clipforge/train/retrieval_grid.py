"""Retrieval samples at every validation, drawn for TensorBoard.

Retrieval samples at every validation: what the model finds for a few fixed validation queries,
for TensorBoard (people would rather look than read numbers).

The gallery is the first GALLERY_SIZE pairs of the validation split in shard order, the same at
every validation; the queries are its first NUM_QUERIES captions and images.
- `samples/text_to_image` (an image): a row per query caption: the caption over the TOP_K
  images it retrieves from the gallery, best first, each correct one (an image whose own caption
  is that caption) framed green, the others grey. The caption is drawn with a CJK font when
  one is found (CJK_FONTS); without one the row is labelled q1, q2... and the caption is in
  the text below. A header names the rank columns and a legend under the rows says what the
  frames mean, so the image reads on its own in TensorBoard. The grid is as wide as TensorBoard's
  image card shows an image (CARD_PIXELS, unless "Show actual image size" is ticked), the caption
  above its images rather than beside them: a wider grid is shrunk to the card, and its text
  with it (a 600-pixel grid's captions were 9 pixels high there).
- `samples/text_to_image_queries` (text): each query's caption and the rank of its first correct
  image.
- `samples/image_to_text` (text): for each query image, the TOP_K captions it retrieves, the
  correct ones marked.

Every rank encodes the gallery (ZeRO-3 gathers each layer's parameters from all ranks, so every
rank must run every forward); rank 0 draws and writes. The run store uploads these with the
other TensorBoard events.
"""

from __future__ import annotations

import io
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from clipforge.train import loader as train_loader

GALLERY_SIZE = 64
NUM_QUERIES = 4
TOP_K = 5
CARD_PIXELS = 350  # the width TensorBoard's image card shows an image at, by default
FRAME_PIXELS = 3
THUMB_PIXELS = CARD_PIXELS // TOP_K - 2 * FRAME_PIXELS
CELL_PIXELS = THUMB_PIXELS + 2 * FRAME_PIXELS  # a framed image
GRID_PIXELS = CELL_PIXELS * TOP_K  # the grid's width, whatever the gallery's size
CAPTION_FONT_PIXELS = 16  # a CJK caption
LABEL_FONT_PIXELS = 13  # the Latin labels: q1, rank 1, the legend
CAPTION_LINES = 2
LINE_GAP_PIXELS = 6  # between a caption's lines: apart, not touching
CAPTION_PIXELS = 44  # the band over a row's images: CAPTION_LINES of the caption
HEADER_PIXELS = 18  # the band above the rows: `rank 1`...
LEGEND_PIXELS = 20  # the band under them: what green and grey frames mean
SWATCH_PIXELS = 12
CORRECT, OTHER = (0, 170, 0), (170, 170, 170)
# CJK fonts looked for, in this order: shipped with the package, then where common systems keep
# theirs (Debian/Ubuntu fonts-wqy-microhei, fonts-wqy-zenhei, fonts-noto-cjk; macOS; Windows).
CJK_FONTS = (
    *sorted(str(p) for p in (Path(__file__).parents[1] / "fonts").glob("*.tt[fc]")),
    "/usr/share/fonts/truetype/wqy/wqy-microhei.ttc",
    "/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc",
    "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",
    "/usr/share/fonts/noto-cjk/NotoSansCJK-Regular.ttc",
    "/System/Library/Fonts/PingFang.ttc",
    "C:/Windows/Fonts/msyh.ttc",
)


@dataclass
class SampleGallery:
    images: torch.Tensor  # uint8 pixels of the validation preprocessing (to_device normalises)
    tokens: torch.Tensor
    captions: list[str]
    thumbnails: list[Image.Image]

    @property
    def num_queries(self) -> int:
        return min(NUM_QUERIES, len(self.captions))


def load_gallery(data_dir: Path, transform, tokenizer) -> SampleGallery | None:
    """The first GALLERY_SIZE validation pairs, their pixels by `transform` (uint8, as the loaders
    give them: the run's to_device normalises them); None without a validation split of two pairs."""
    files = train_loader.split_files(data_dir, "val")
    positions = [
        (shard, index) for shard, count in enumerate(files.counts) for index in range(count)
    ][:GALLERY_SIZE]
    if len(positions) < 2:
        return None
    reader = files.reader()
    images, captions, thumbnails = [], [], []
    for shard, index in positions:
        sample = reader.read(shard, index)
        image = Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
        images.append(transform(image))
        captions.append(sample["txt"].decode("utf-8"))
        thumbnails.append(image.resize((THUMB_PIXELS, THUMB_PIXELS)))
    return SampleGallery(torch.stack(images), tokenizer(captions), captions, thumbnails)


@torch.no_grad()
def rankings(
    model, gallery: SampleGallery, to_device, autocast=nullcontext
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top images per query caption, top captions per query image): gallery indices, best
    first. Every rank calls this (one forward each, in eval mode and the run's autocast, as
    validation; the model's mode is restored afterwards)."""
    images, tokens = to_device([(gallery.images, gallery.tokens)])  # one chunk
    was_training = model.training
    model.eval()
    try:
        with autocast():
            out = model(image=images, text=tokens)
    finally:
        model.train(was_training)
    image_features, text_features = out["image_features"].float(), out["text_features"].float()
    k = min(TOP_K, len(gallery.captions))
    queries = slice(0, gallery.num_queries)
    text_to_image = (text_features[queries] @ image_features.T).topk(k, dim=1).indices
    image_to_text = (image_features[queries] @ text_features.T).topk(k, dim=1).indices
    return text_to_image.cpu(), image_to_text.cpu()


def render(
    gallery: SampleGallery, text_to_image: torch.Tensor, image_to_text: torch.Tensor
) -> tuple[np.ndarray, dict[str, str]]:
    """The grid, and the texts by TensorBoard tag."""
    return text_to_image_grid(gallery, text_to_image), {
        "samples/text_to_image_queries": text_to_image_queries(gallery, text_to_image),
        "samples/image_to_text": image_to_text_text(gallery, image_to_text),
    }


def text_to_image_grid(gallery: SampleGallery, text_to_image: torch.Tensor) -> np.ndarray:
    """The image grid, HWC uint8: a header naming the rank columns; a row per query, its caption
    (or label) over its top images; a legend of the frames' colours."""
    font = cjk_font()
    rows = text_to_image.shape[0]
    grid = Image.new("RGB", (GRID_PIXELS, band_top(rows) + LEGEND_PIXELS), "white")
    draw = ImageDraw.Draw(grid)
    _draw_header(draw)
    for row, found in enumerate(text_to_image.tolist()):
        top = row_top(row)
        caption_top = band_top(row) + 3
        if font:
            label = f"q{row + 1} {gallery.captions[row]}"
            _draw_wrapped(draw, label, font, (4, caption_top), GRID_PIXELS - 8)
        else:
            draw.text((4, caption_top), f"q{row + 1}", font=_label_font(), fill="black")
        for column, index in enumerate(found):
            left = column * CELL_PIXELS
            colour = CORRECT if _same_caption(gallery, row, index) else OTHER
            draw.rectangle([left, top, left + CELL_PIXELS - 1, top + CELL_PIXELS - 1], fill=colour)
            grid.paste(gallery.thumbnails[index], (left + FRAME_PIXELS, top + FRAME_PIXELS))
    _draw_legend(draw, band_top(rows))
    return np.asarray(grid)


def band_top(row: int) -> int:
    """The y of a query row's first pixel (its caption's band); of the legend, after the last."""
    return HEADER_PIXELS + row * (CAPTION_PIXELS + CELL_PIXELS)


def row_top(row: int) -> int:
    """The y of a query row's framed images (their frames' top edge), under its caption."""
    return band_top(row) + CAPTION_PIXELS


def _draw_header(draw) -> None:
    small = _label_font()
    for column in range(TOP_K):
        centre = column * CELL_PIXELS + CELL_PIXELS // 2
        label = f"rank {column + 1}"
        draw.text((centre - small.getlength(label) / 2, 2), label, font=small, fill="black")


def _draw_legend(draw, top: int) -> None:
    small = _label_font()
    left, y = 4, top + (LEGEND_PIXELS - SWATCH_PIXELS) // 2
    for colour, meaning in ((CORRECT, "the query's own image"), (OTHER, "another image")):
        draw.rectangle([left, y, left + SWATCH_PIXELS - 1, y + SWATCH_PIXELS - 1], fill=colour)
        left += SWATCH_PIXELS + 4
        draw.text((left, y - 1), meaning, font=small, fill="black")
        left += int(small.getlength(meaning)) + 16


@lru_cache(maxsize=1)
def _label_font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Latin labels: Pillow's own font (it ships one; no system font needed)."""
    return ImageFont.load_default(LABEL_FONT_PIXELS)


def text_to_image_queries(gallery: SampleGallery, text_to_image: torch.Tensor) -> str:
    lines = ["| query | caption | rank of the first correct image |", "|---|---|---|"]
    for row, found in enumerate(text_to_image.tolist()):
        ranks = [r for r, index in enumerate(found, 1) if _same_caption(gallery, row, index)]
        rank = str(ranks[0]) if ranks else f"not in the top {len(found)}"
        lines.append(f"| q{row + 1} | {gallery.captions[row]} | {rank} |")
    return "\n".join(lines)


def image_to_text_text(gallery: SampleGallery, image_to_text: torch.Tensor) -> str:
    """Markdown: each query image's own caption, then the captions it retrieves (✓ correct)."""
    blocks = []
    for row, found in enumerate(image_to_text.tolist()):
        items = [
            f"{rank}. {'✓' if _same_caption(gallery, row, index) else '✗'} "
            f"{gallery.captions[index]}"
            for rank, index in enumerate(found, 1)
        ]
        blocks.append(
            f"**image q{row + 1}** (its caption: {gallery.captions[row]})\n\n" + "\n".join(items)
        )
    return "\n\n".join(blocks)


def _same_caption(gallery: SampleGallery, query: int, index: int) -> bool:
    return gallery.captions[index] == gallery.captions[query]


@lru_cache(maxsize=1)
def cjk_font() -> ImageFont.FreeTypeFont | None:
    for path in CJK_FONTS:
        if Path(path).is_file():
            try:
                return ImageFont.truetype(path, CAPTION_FONT_PIXELS)
            except OSError:
                continue
    return None


def _draw_wrapped(draw, text: str, font, origin: tuple[int, int], width: int) -> None:
    """Character by character (Chinese has no spaces to break at), as many lines as fit."""
    lines, line = [], ""
    for char in text:
        if font.getlength(line + char) > width:
            lines.append(line)
            line = ""
        line += char
    lines.append(line)
    shown = lines[:CAPTION_LINES]
    if len(lines) > CAPTION_LINES:  # the whole caption is in samples/text_to_image_queries
        shown[-1] = shown[-1][:-1] + "…"
    draw.multiline_text(origin, "\n".join(shown), font=font, fill="black", spacing=LINE_GAP_PIXELS)
