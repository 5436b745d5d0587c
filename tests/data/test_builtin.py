"""The built-in dataset: deterministic, and a real retrieval task (unique captions, near misses)."""

from __future__ import annotations

import hashlib

from clipforge.data import builtin


def _digest(items) -> str:
    h = hashlib.sha256()
    for item in items:
        h.update(item.jpeg)
        h.update(repr(getattr(item, "caption", getattr(item, "captions", ""))).encode())
    return h.hexdigest()


def test_same_seed_gives_identical_bytes_and_another_seed_does_not():
    """Generation is a pure function of (seed, split, index)."""
    first = _digest(builtin.pairs(3, "train", 20, 32, set()))
    again = _digest(builtin.pairs(3, "train", 20, 32, set()))
    other = _digest(builtin.pairs(4, "train", 20, 32, set()))
    assert first == again != other


def test_test_captions_are_all_unique():
    _, images = builtin.test_images(0, 200, 32)
    captions = [c for image in images for c in image.captions]
    assert len(captions) == 400 and len(set(captions)) == 400


def test_test_set_is_made_of_near_miss_groups():
    """Most test scenes have another test scene differing in exactly one attribute of one object,
    so a model that ignores colour, shape or position cannot rank the right one first."""
    scenes = builtin.test_scenes(0, 200)

    def attributes(scene):
        return {(o.position, o.colour, o.shape) for o in scene}

    def one_change_apart(a, b):
        if len(a) != len(b):
            return False
        return len(attributes(a) ^ attributes(b)) == 2 or (
            len(a) == 2
            and {o.position for o in a} == {o.position for o in b}
            and sorted((o.colour, o.shape) for o in a) != sorted((o.colour, o.shape) for o in b)
            and {o.colour for o in a} == {o.colour for o in b}
        )

    with_neighbour = sum(any(one_change_apart(s, t) for t in scenes if t != s) for s in scenes)
    assert with_neighbour >= 0.8 * len(scenes)


def test_training_pairs_never_show_a_test_scene():
    scenes, _ = builtin.test_images(0, 50, 32)
    test_captions = {c for scene in scenes for c in builtin.captions(scene)}
    train_captions = {p.caption for p in builtin.pairs(0, "train", 3000, 32, set(scenes))}
    assert not train_captions & test_captions


def test_caption_names_colour_shape_and_position_of_every_object():
    scene = builtin.canonical([builtin.Obj(0, "红色", "圆形"), builtin.Obj(8, "蓝色", "三角形")])
    assert builtin.captions(scene) == [
        "左上角有一个红色的圆形，右下角有一个蓝色的三角形",
        "右下角有一个蓝色的三角形，左上角有一个红色的圆形",
    ]
