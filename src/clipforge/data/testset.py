"""Test sets in Chinese-CLIP's layout, the format Flickr30K-CN, COCO-CN and MUGE ship in.

  test_imgs.tsv     one image per line: `<image_id>\t<base64 of the image file>`
  test_texts.jsonl  one caption per line: {"text_id": int, "text": str, "image_ids": [int, ...]}

A caption may list several images and an image may have several captions (Flickr30K-CN has
five), so the relevance judgements are the `image_ids` lists, not positions.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

IMAGES_FILE = "test_imgs.tsv"
TEXTS_FILE = "test_texts.jsonl"


@dataclass(frozen=True)
class Caption:
    text_id: int
    text: str
    image_ids: tuple[int, ...]


def write_test_set(directory: Path, images: Iterable[tuple[int, bytes, list[str]]]) -> dict:
    """Write (image_id, image bytes, captions) items; text ids are assigned in order."""
    directory.mkdir(parents=True, exist_ok=True)
    num_images = num_texts = 0
    with (
        open(directory / IMAGES_FILE, "w", encoding="utf-8") as imgs,
        open(directory / TEXTS_FILE, "w", encoding="utf-8") as texts,
    ):
        for image_id, image_bytes, captions in images:
            imgs.write(f"{image_id}\t{base64.b64encode(image_bytes).decode('ascii')}\n")
            num_images += 1
            for caption in captions:
                record = {"text_id": num_texts, "text": caption, "image_ids": [image_id]}
                texts.write(json.dumps(record, ensure_ascii=False) + "\n")
                num_texts += 1
    return {"images": num_images, "texts": num_texts}


def read_images(directory: Path) -> Iterator[tuple[int, bytes]]:
    with open(Path(directory) / IMAGES_FILE, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            image_id, sep, payload = line.rstrip("\n").partition("\t")
            if not sep:
                raise ValueError(f"{IMAGES_FILE}:{line_number}: expected `image_id<TAB>base64`")
            yield int(image_id), base64.b64decode(payload)


def read_texts(directory: Path) -> list[Caption]:
    texts = []
    with open(Path(directory) / TEXTS_FILE, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                texts.append(
                    Caption(
                        int(item["text_id"]),
                        str(item["text"]),
                        tuple(int(i) for i in item["image_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{TEXTS_FILE}:{line_number}: expected "
                    f'{{"text_id", "text", "image_ids"}} ({exc})'
                ) from None
    return texts


def check_test_set(directory: Path) -> dict:
    """Counts of a test set, after checking that every caption points at an existing image."""
    image_ids = [image_id for image_id, _ in read_images(directory)]
    texts = read_texts(directory)
    known = set(image_ids)
    for text in texts:
        missing = [i for i in text.image_ids if i not in known]
        if missing:
            raise ValueError(
                f"{TEXTS_FILE}: text_id {text.text_id} refers to image ids {missing} "
                f"that are not in {IMAGES_FILE}"
            )
    return {"images": len(image_ids), "texts": len(texts)}
