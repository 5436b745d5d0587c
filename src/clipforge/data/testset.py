"""Test sets: retrieval sets in Chinese-CLIP's layout, and zero-shot classification sets.

Retrieval sets in Chinese-CLIP's layout, the format Flickr30K-CN, COCO-CN and MUGE
ship in, and zero-shot classification sets (below: labelled images).

  test_imgs.tsv     one image per line: `<image_id>\t<base64 of the image file>`
  test_texts.jsonl  one caption per line: {"text_id": int, "text": str, "image_ids": [int, ...]}

A caption may list several images and an image may have several captions (Flickr30K-CN has
five), so the relevance judgements are the `image_ids` lists, not positions.

A test set is read whole and checked before anything is encoded: a duplicated id shifts every
recall a little, an unknown id cannot be scored at all, so either is an error, reported with one
line per problem naming the file, the line and the id.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from clipforge.errors import UserError
from clipforge.metrics.sizes import MIN_CLASSES, DirectionSize, direction_sizes
from clipforge.util import first_line, short_repr

IMAGES_FILE = "test_imgs.tsv"
TEXTS_FILE = "test_texts.jsonl"
MAX_PROBLEMS_SHOWN = 20


@dataclass(frozen=True)
class Caption:
    text_id: int
    text: str
    image_ids: tuple[int, ...]


@dataclass(frozen=True)
class TestSet:
    __test__ = False  # not a pytest test class, whatever its name

    image_ids: list[int]
    images: list[bytes]  # the image files, in the order of image_ids
    texts: list[Caption]

    def counts(self) -> dict:
        return {"images": len(self.image_ids), "texts": len(self.texts)}

    def direction_sizes(self, directions: str = "both") -> list[DirectionSize]:
        """Queries and candidates of each direction scored (clipforge.metrics.sizes)."""
        described = {i for text in self.texts for i in text.image_ids}
        return direction_sizes(len(self.image_ids), len(self.texts), len(described), directions)


class TestSetError(UserError, ValueError):
    """Everything wrong with a test set, one line per problem."""

    __test__ = False

    def __init__(self, problems: list[str]):
        shown = problems[:MAX_PROBLEMS_SHOWN]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more problems")
        super().__init__("\n".join(shown))
        self.problems = problems


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


def load_test_set(directory: Path) -> TestSet:
    """The whole test set, checked: ids unique, every referenced image present, no empty file,
    every image decodable. TestSetError lists every problem found."""
    directory = Path(directory)
    problems: list[str] = []
    images = _read_images(directory / IMAGES_FILE, problems)
    texts = _read_texts(directory / TEXTS_FILE, set(images), problems)
    if problems:
        raise TestSetError(problems)
    return TestSet(list(images), list(images.values()), texts)


def check_test_set(directory: Path) -> dict:
    """Counts of a test set, once `load_test_set` found nothing wrong with it."""
    return load_test_set(directory).counts()


def _lines(path: Path, what: str, problems: list[str]) -> list[tuple[int, str]]:
    """Numbered non-blank lines; a missing or empty file is a problem."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line.rstrip("\r\n")) for n, line in enumerate(f, start=1) if line.strip()]
    except FileNotFoundError:
        problems.append(
            f"{path} not found: a test set in Chinese-CLIP layout has {IMAGES_FILE} and "
            f"{TEXTS_FILE}"
        )
        return []
    except UnicodeDecodeError as exc:
        problems.append(f"{path}: not UTF-8 text (byte offset {exc.start})")
        return []
    if not lines:
        problems.append(f"{path}: empty: no {what}")
    return lines


def _read_images(path: Path, problems: list[str]) -> dict[int, bytes]:
    images: dict[int, bytes] = {}
    first_line: dict[int, int] = {}
    for n, line in _lines(path, "images", problems):
        raw_id, sep, payload = line.partition("\t")
        if not sep:
            problems.append(f"{path}:{n}: expected `image_id<TAB>base64`")
            continue
        image_id = _int(raw_id)
        if image_id is None:
            problems.append(f"{path}:{n}: image id {short_repr(raw_id)} is not an integer")
            continue
        try:
            image = base64.b64decode(payload, validate=True)
        except binascii.Error as exc:
            problems.append(f"{path}:{n}: image id {image_id}: not base64 ({exc})")
            continue
        if image_id in first_line:
            same = "the same image" if images[image_id] == image else "a different image"
            problems.append(
                f"{path}:{n}: image id {image_id} again ({same}; first on line "
                f"{first_line[image_id]}): ids must be unique"
            )
            continue
        reason = _undecodable(image)
        if reason:
            problems.append(f"{path}:{n}: image id {image_id}: not a decodable image ({reason})")
        first_line[image_id] = n
        images[image_id] = image
    return images


def _read_texts(path: Path, image_ids: set[int], problems: list[str]) -> list[Caption]:
    texts: list[Caption] = []
    first_line: dict[int, int] = {}
    for n, line in _lines(path, "captions", problems):
        caption = _caption(line)
        if caption is None:
            problems.append(
                f'{path}:{n}: expected {{"text_id": int, "text": str, "image_ids": [int, ...]}}'
            )
            continue
        where = f"{path}:{n}: text id {caption.text_id}"
        if caption.text_id in first_line:
            problems.append(
                f"{where} again (first on line {first_line[caption.text_id]}): ids must be unique"
            )
            continue
        first_line[caption.text_id] = n
        if not caption.text.strip():
            problems.append(f"{where}: empty text")
        if not caption.image_ids:
            problems.append(f"{where}: lists no image ids, so it has no right answer")
        unknown = [i for i in caption.image_ids if i not in image_ids]
        if unknown and image_ids:  # with no readable image at all, that is the problem reported
            problems.append(
                f"{where} refers to image id {unknown[0]}, which {IMAGES_FILE} does not have"
                + (f" ({len(unknown) - 1} more unknown)" if len(unknown) > 1 else "")
            )
        texts.append(caption)
    return texts


def _caption(line: str) -> Caption | None:
    try:
        item = json.loads(line)
        text_id, text, ids = item["text_id"], item["text"], item["image_ids"]
    except (ValueError, KeyError, TypeError):
        return None
    image_ids = [_int(i) for i in ids] if isinstance(ids, list) else [None]
    number = _int(text_id)
    if number is None or not isinstance(text, str) or None in image_ids:
        return None
    return Caption(number, text, tuple(i for i in image_ids if i is not None))


def _int(value) -> int | None:
    """An id: an integer, or a string of one (some converted sets quote them)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(value.strip()) if isinstance(value, str) else None
    except ValueError:
        return None


def _undecodable(image: bytes) -> str | None:
    """None when the image decodes, else why not. JPEGs are decoded at 1/8 scale (draft mode):
    a damaged file fails just the same, in a fraction of the time."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(image)) as decoded:
                if decoded.format == "JPEG":
                    decoded.draft("RGB", (decoded.width // 8 or 1, decoded.height // 8 or 1))
                decoded.load()
    except Image.UnidentifiedImageError:
        return "not an image format Pillow reads"
    except Exception as exc:  # PIL raises many types for broken files: all mean the same here
        return first_line(exc)
    return None


# ---------------------------------------------------------------------------------------------
# Zero-shot classification sets: labelled images, in either of two layouts
#   a folder with a folder of images per class (`path/<label>/*.jpg`), as Chinese-CLIP ships
#     ImageNet-CN and the ELEVATER sets (`test/000/`, ... beside label_cn.txt);
#   a .tsv of `image<TAB>label` lines, image paths relative to the .tsv's folder.
# A label is the class name itself, or, with a class names file (one name per line), the 0-based
# line number of its name (`000` is line 1).

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff"})


@dataclass(frozen=True)
class ClassificationSet:
    __test__ = False

    images: list[Path]  # image files, read when encoded
    labels: list[int]  # index into class_names, one per image
    class_names: list[str]

    def counts(self) -> dict:
        return {"images": len(self.images), "classes": len(self.class_names)}


def write_classification_set(
    directory: Path, class_names: list[str], images: Iterable[tuple[int, bytes]]
) -> dict:
    """Chinese-CLIP's layout: label_cn.txt (`directory/label_cn.txt`) and `directory/test/NNN/`
    folders of JPEGs, NNN the class's line number. `images`: (class index, JPEG bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "label_cn.txt").write_text("".join(f"{n}\n" for n in class_names), "utf-8")
    width = max(3, len(str(len(class_names) - 1)))  # zero-padded: folders sort as the lines
    num_images = 0
    for label, jpeg in images:
        folder = directory / "test" / f"{label:0{width}d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{num_images:06d}.jpg").write_bytes(jpeg)
        num_images += 1
    return {"images": num_images, "classes": len(class_names)}


def classification_set_sha256(directory: Path) -> str:
    """One hash of every file under `directory` and its path there: what the manifest records."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(directory).as_posix()}\0".encode())
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def load_classification_set(path: Path, classes: Path | None) -> ClassificationSet:
    """The labelled images and class names, checked: every label known, every class with images
    (so the task scored is the N-way one the suite names, each class's name on its own line),
    at least MIN_CLASSES classes, every image file there and of a format Pillow recognises (its
    header: decoding a large set up front would cost as much as encoding it; an image that fails
    to decode later stops the stage naming its file). TestSetError lists every problem found."""
    path = Path(path)
    problems: list[str] = []
    names = _class_names(Path(classes), problems) if classes is not None else None
    if path.is_dir():
        pairs = _class_folders(path, problems)
    elif path.is_file():
        pairs = _labelled_lines(path, problems)
    else:
        problems.append(f"{path} not found: a folder of class folders or an image<TAB>label .tsv")
        pairs = []
    if not pairs and not problems:
        problems.append(f"{path}: no images")
    labels, class_names = _labels(pairs, names, classes, problems)
    if not problems:
        _check_classes(path, labels, class_names, classes, problems)
    for image, _ in pairs:
        reason = _unrecognised(image)
        if reason:
            problems.append(f"{image}: not an image Pillow reads ({reason})")
    if problems:
        raise TestSetError(problems)
    return ClassificationSet([image for image, _ in pairs], labels, class_names)


def _class_names(path: Path, problems: list[str]) -> list[str]:
    """Line n (0-based) is class n: a blank line inside the file would shift every later class
    onto another's images, so it is a problem; blank lines at the end are not."""
    if not path.is_file():
        problems.append(f"{path} not found: the class names file, one name per line")
        return []
    lines = _lines(path, "class names", problems)
    last = lines[-1][0] if lines else 0
    numbered = {n for n, _ in lines}
    for n in range(1, last):
        if n not in numbered:
            problems.append(
                f"{path}:{n}: a blank line: class {n - 1} has no name, and every class after it "
                f"would be scored under the name of the next; one name per line"
            )
    return [text.strip() for _, text in lines]


def _class_folders(path: Path, problems: list[str]) -> list[tuple[Path, str]]:
    folders = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        problems.append(f"{path}: no class folders (a folder of images per class)")
    pairs = []
    for folder in folders:
        images = [
            image
            for image in sorted(folder.iterdir())
            if image.suffix.lower() in IMAGE_SUFFIXES and not image.name.startswith(".")
        ]
        if not images:
            problems.append(
                f"{folder}: an empty class folder (no {'/'.join(sorted(IMAGE_SUFFIXES))}): "
                f"the suite would be scored as a task without this class; give its images, or "
                f"remove the class"
            )
        pairs += [(image, folder.name) for image in images]
    return pairs


def _labelled_lines(path: Path, problems: list[str]) -> list[tuple[Path, str]]:
    pairs = []
    for n, line in _lines(path, "images", problems):
        image, sep, label = line.partition("\t")
        if not sep or not image.strip() or not label.strip():
            problems.append(f"{path}:{n}: expected `image<TAB>label`")
            continue
        file = path.parent / image.strip()
        if not file.is_file():
            problems.append(f"{path}:{n}: {file} not found")
            continue
        pairs.append((file, label.strip()))
    return pairs


def _labels(
    pairs: list[tuple[Path, str]],
    names: list[str] | None,
    classes: Path | None,
    problems: list[str],
) -> tuple[list[int], list[str]]:
    if names is None:
        if pairs and all(_int(label) is not None for _, label in pairs):
            problems.append(
                f"labels are numbers ({pairs[0][1]}, ...): give the class names file (classes)"
            )
        class_names = sorted({label for _, label in pairs})
        index = {name: i for i, name in enumerate(class_names)}
        return [index[label] for _, label in pairs], class_names
    labels = []
    for image, label in pairs:
        number = _int(label)
        if number is None or not 0 <= number < len(names):
            problems.append(
                f"{image}: label {short_repr(label)} is not a line number of {classes} "
                f"(0 to {len(names) - 1})"
            )
            continue
        labels.append(number)
    return labels, names


def _check_classes(
    path: Path, labels: list[int], class_names: list[str], classes: Path | None, problems: list[str]
) -> None:
    """At least MIN_CLASSES classes, each with images: with a class names file, one class folder
    (or .tsv label) per line of it."""
    if len(class_names) < MIN_CLASSES:
        where = classes if classes is not None else path
        problems.append(
            f"{where}: only {len(class_names)} class: a zero-shot classification needs at least "
            f"{MIN_CLASSES} (over one class, top-1 is 100% whatever the model)"
        )
        return
    if classes is None:  # the classes are the labels found: each has images
        return
    used = set(labels)
    missing = [n for n in range(len(class_names)) if n not in used]
    if missing:
        shown = ", ".join(f"{n} ({class_names[n]}, line {n + 1})" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        problems.append(
            f"{path}: no images for {len(missing)} of the {len(class_names)} classes of "
            f"{classes}: {shown}{more}; each class needs images (a partial download, or a "
            f"class names file of another set?)"
        )


def _unrecognised(image: Path) -> str | None:
    try:
        with Image.open(image):
            return None
    except Image.UnidentifiedImageError:
        return "not an image format Pillow reads"
    except OSError as exc:
        return first_line(exc)
