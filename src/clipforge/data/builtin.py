"""The built-in dataset: rendered scenes of coloured shapes with Chinese captions.

A scene has one or two objects, each a (colour, shape, position on a 3x3 grid). Captions name
all three attributes of every object ("左上角有一个红色的圆形，右下角有一个蓝色的三角形"), so
retrieval is only solved by a model that binds colour, shape and position. The test set is built
from groups of near-misses: a base scene plus variants that change exactly one attribute of one
object, or swap colours or positions between the two objects. Test scenes never appear in
training, and every test caption is unique.

Everything is a pure function of (seed, split, index): the same parameters give the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from clipforge.data.samples import encode_jpeg

COLOURS = {  # name -> RGB; chosen to stay distinct after JPEG compression at 64 px
    "红色": (215, 40, 40),
    "橙色": (245, 145, 25),
    "黄色": (230, 205, 25),
    "绿色": (40, 165, 60),
    "蓝色": (40, 85, 215),
    "紫色": (145, 60, 185),
}
SHAPES = ("圆形", "正方形", "三角形", "十字形")
POSITIONS = ("左上角", "上方", "右上角", "左侧", "中间", "右侧", "左下角", "下方", "右下角")

_SPLIT_IDS = {"train": 1, "val": 2, "test": 3, "t2i": 4, "classes": 5}
_SUPERSAMPLE = 2  # draw at 2x and downsample: anti-aliased edges without a drawing library


@dataclass(frozen=True, order=True)
class Obj:
    position: int  # index into POSITIONS (row-major 3x3 grid)
    colour: str
    shape: str


Scene = tuple[Obj, ...]  # sorted by position: one canonical form per scene


def canonical(objects: list[Obj] | tuple[Obj, ...]) -> Scene:
    return tuple(sorted(objects))


def describe(obj: Obj) -> str:
    return f"{POSITIONS[obj.position]}有一个{obj.colour}的{obj.shape}"


def captions(scene: Scene) -> list[str]:
    """Two distinct phrasings: objects in reading order, and in reverse (or reworded if alone)."""
    if len(scene) == 1:
        (obj,) = scene
        return [
            describe(obj),
            f"图中只有一个{obj.colour}的{obj.shape}，位于{POSITIONS[obj.position]}",
        ]
    forward = "，".join(describe(o) for o in scene)
    backward = "，".join(describe(o) for o in reversed(scene))
    return [forward, backward]


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, _SPLIT_IDS[split], index])


def random_scene(rng: np.random.Generator) -> Scene:
    count = 1 if rng.random() < 0.15 else 2
    positions = rng.choice(len(POSITIONS), size=count, replace=False)
    colour_names = list(COLOURS)
    return canonical(
        [
            Obj(
                int(p),
                colour_names[rng.integers(len(colour_names))],
                SHAPES[rng.integers(len(SHAPES))],
            )
            for p in positions
        ]
    )


def near_misses(scene: Scene, rng: np.random.Generator) -> list[Scene]:
    """Scenes that differ from `scene` in exactly one way, in random order."""
    variants = []
    for i, obj in enumerate(scene):
        others = [o for j, o in enumerate(scene) if j != i]
        taken = {o.position for o in others}
        colour = [c for c in COLOURS if c != obj.colour]
        shape = [s for s in SHAPES if s != obj.shape]
        free = [p for p in range(len(POSITIONS)) if p not in taken and p != obj.position]
        variants.append(
            canonical(others + [Obj(obj.position, colour[rng.integers(len(colour))], obj.shape)])
        )
        variants.append(
            canonical(others + [Obj(obj.position, obj.colour, shape[rng.integers(len(shape))])])
        )
        variants.append(
            canonical(others + [Obj(free[rng.integers(len(free))], obj.colour, obj.shape)])
        )
    if len(scene) == 2:
        a, b = scene
        if a.colour != b.colour:
            variants.append(
                canonical([Obj(a.position, b.colour, a.shape), Obj(b.position, a.colour, b.shape)])
            )
        if a.shape != b.shape:
            variants.append(
                canonical([Obj(a.position, a.colour, b.shape), Obj(b.position, b.colour, a.shape)])
            )
    order = rng.permutation(len(variants))
    return [variants[i] for i in order]


def test_scenes(
    seed: int,
    num_images: int,
    group_size: int = 5,
    split: str = "test",
    exclude: frozenset = frozenset(),
) -> list[Scene]:
    """Unique scenes in groups of near-misses: a base scene and up to group_size-1 variants
    (none of them in `exclude`)."""
    rng = _rng(seed, split, 0)
    chosen: list[Scene] = []
    seen: set[Scene] = set(exclude)
    while len(chosen) < num_images:
        base = random_scene(rng)
        if len(base) < 2 or base in seen:
            continue
        group = [base] + [v for v in near_misses(base, rng) if v not in seen and v != base]
        for scene in group[:group_size]:
            if len(chosen) < num_images and scene not in seen:
                seen.add(scene)
                chosen.append(scene)
    return chosen


def render(scene: Scene, rng: np.random.Generator, size: int) -> Image.Image:
    """Draw the scene with random size, jitter, background tint and noise."""
    big = size * _SUPERSAMPLE
    cell = big / 3
    background = tuple(int(v) for v in rng.integers(200, 250, size=3))
    image = Image.new("RGB", (big, big), background)
    draw = ImageDraw.Draw(image)
    for obj in scene:
        row, col = divmod(obj.position, 3)
        extent = cell * rng.uniform(0.5, 0.8)
        slack = (cell - extent) / 2
        cx = (col + 0.5) * cell + rng.uniform(-slack, slack) * 0.8
        cy = (row + 0.5) * cell + rng.uniform(-slack, slack) * 0.8
        _draw_shape(draw, obj.shape, cx, cy, extent / 2, COLOURS[obj.colour])
    image = image.resize((size, size), Image.Resampling.BILINEAR)
    pixels = np.asarray(image, dtype=np.int16) + rng.integers(-8, 9, size=(size, size, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    cx: float,
    cy: float,
    r: float,
    colour: tuple[int, int, int],
) -> None:
    if shape == "圆形":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif shape == "正方形":
        s = r * 0.85
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=colour)
    elif shape == "三角形":
        draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=colour)
    elif shape == "十字形":
        w = r * 0.38
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=colour)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=colour)
    else:  # pragma: no cover - SHAPES is closed
        raise ValueError(shape)


@dataclass(frozen=True)
class Pair:
    key: str
    jpeg: bytes
    caption: str


@dataclass(frozen=True)
class CaptionedImage:
    image_id: int
    jpeg: bytes
    captions: list[str]


def pairs(seed: int, split: str, count: int, size: int, exclude: set[Scene]) -> Iterator[Pair]:
    """Training or validation pairs: random scenes not in `exclude`, one caption each."""
    for index in range(count):
        rng = _rng(seed, split, index)
        scene = random_scene(rng)
        while scene in exclude:
            scene = random_scene(rng)
        caption = captions(scene)[int(rng.integers(2))]
        yield Pair(f"{split}-{index:08d}", encode_jpeg(render(scene, rng, size)), caption)


def test_images(seed: int, count: int, size: int) -> tuple[list[Scene], Iterator[CaptionedImage]]:
    scenes = test_scenes(seed, count)

    def generate() -> Iterator[CaptionedImage]:
        for index, scene in enumerate(scenes):
            rng = _rng(seed, "test", index + 1)
            yield CaptionedImage(index, encode_jpeg(render(scene, rng, size)), captions(scene))

    return scenes, generate()


def t2i_suite_images(
    seed: int, count: int, size: int, exclude: set[Scene]
) -> tuple[list[Scene], Iterator[CaptionedImage]]:
    """The demo's text-to-image-only suite, in the manner of MUGE: near-miss groups of scenes
    (none of `exclude`, the test set's), every other image described by one caption and the
    rest distractors that no caption describes, so image-to-text has no full set of queries."""
    scenes = test_scenes(seed, count, split="t2i", exclude=frozenset(exclude))

    def generate() -> Iterator[CaptionedImage]:
        for index, scene in enumerate(scenes):
            rng = _rng(seed, "t2i", index + 1)
            described = [captions(scene)[0]] if index % 2 == 0 else []
            yield CaptionedImage(index, encode_jpeg(render(scene, rng, size)), described)

    return scenes, generate()


# The demo's zero-shot classes: every colour and shape of the generator, named as its captions
# name them ("红色的圆形").
CLASS_NAMES = [f"{colour}的{shape}" for colour in COLOURS for shape in SHAPES]


def classification_images(seed: int, count: int, size: int) -> Iterator[tuple[int, bytes]]:
    """(class index into CLASS_NAMES, JPEG) of one-object scenes, the classes in turn, each
    object anywhere. Their scenes may occur in training, as cats do in a web crawl before
    ImageNet: zero-shot means no training on the labels, and each image is a new drawing."""
    for index in range(count):
        rng = _rng(seed, "classes", index)
        label = index % len(CLASS_NAMES)
        colour, shape = divmod(label, len(SHAPES))
        obj = Obj(int(rng.integers(len(POSITIONS))), list(COLOURS)[colour], SHAPES[shape])
        yield label, encode_jpeg(render((obj,), rng, size))
