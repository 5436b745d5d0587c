"""eval.suites: the suites' files read and checked before any model loads (no model here)."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from PIL import Image

from clipforge.config import resolve
from clipforge.data.testset import (
    TestSetError,
    load_classification_set,
    write_classification_set,
    write_test_set,
)
from clipforge.eval.config import EvalParams
from clipforge.eval.suites import DEFAULT_TEMPLATES, load_suites, read_templates
from clipforge.fields import ConfigError
from clipforge.metrics.classification import class_embeddings, zero_shot_accuracy
from clipforge.metrics.retrieval import T2I_KEYS, relevance_matrix, retrieval_metrics
from clipforge.pipeline.recipe import recipe_params


def _jpeg(colour=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, "JPEG")
    return out.getvalue()


def test_the_shipped_templates_are_a_documented_chinese_set():
    """templates_zh.txt says in its header what it is and how to give another; each prompt has
    one `{}` and Chinese words around it."""
    header = [line for line in DEFAULT_TEMPLATES.read_text("utf-8").splitlines() if line[:1] == "#"]
    assert any("{}" in line for line in header) and any("templates" in line for line in header)
    templates = read_templates(DEFAULT_TEMPLATES)
    assert len(templates) >= 10 and len(set(templates)) == len(templates)
    assert all(t.count("{}") == 1 for t in templates)
    assert sum(bool(re.search(r"[\u4e00-\u9fff]", t)) for t in templates) >= len(templates) - 1


def test_a_template_file_is_checked_line_by_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("# mine\n一张{}的照片\n一张照片\n{}和{}\n\n", "utf-8")
    with pytest.raises(TestSetError) as refused:
        read_templates(path)
    assert refused.value.problems == [
        f"{path}:3: a template needs exactly one `{{}}` (the class name)",
        f"{path}:4: a template needs exactly one `{{}}` (the class name)",
    ]
    path.write_text("# mine\n一张{}的照片\n{}\n", "utf-8")
    assert read_templates(path) == ("一张{}的照片", "{}")


def test_chinese_clip_layout_numbered_folders_and_label_cn(tmp_path):
    """`test/000/...` beside label_cn.txt: folder NNN is the class on line NNN (0-based)."""
    names = ["猫", "狗", "鸟"]
    images = [(2, _jpeg()), (0, _jpeg()), (1, _jpeg()), (2, _jpeg())]
    write_classification_set(tmp_path / "set", names, images)
    assert sorted(p.name for p in (tmp_path / "set" / "test").iterdir()) == ["000", "001", "002"]
    loaded = load_classification_set(tmp_path / "set" / "test", tmp_path / "set" / "label_cn.txt")
    assert loaded.class_names == names
    assert sorted(loaded.labels) == [0, 1, 2, 2] and len(loaded.images) == 4


def _classes(tmp_path, names: list[str], folders: dict[str, int]):
    """label_cn.txt of `names` (written as given) and test/<folder>/ with that many images."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "label_cn.txt").write_text("".join(f"{n}\n" for n in names), "utf-8")
    for folder, count in folders.items():
        (tmp_path / "test" / folder).mkdir(parents=True)
        for i in range(count):
            (tmp_path / "test" / folder / f"{i}.jpg").write_bytes(_jpeg())
    return tmp_path / "test", tmp_path / "label_cn.txt"


def test_a_suite_of_one_class_is_refused_in_either_layout(tmp_path):
    """Over one class every image is classified right: top-1 100 whatever the model."""
    path, names = _classes(tmp_path / "numbered", ["猫"], {"000": 3})
    with pytest.raises(TestSetError) as refused:
        load_classification_set(path, names)
    assert refused.value.problems == [
        f"{names}: only 1 class: a zero-shot classification needs at least 2 (over one class, "
        f"top-1 is 100% whatever the model)"
    ]
    path, _ = _classes(tmp_path / "named", [], {"猫": 2})
    with pytest.raises(TestSetError, match="only 1 class: a zero-shot classification needs"):
        load_classification_set(path, None)


def test_an_empty_class_folder_is_refused_naming_it(tmp_path):
    """4 empty folders of 24 used to be dropped, scoring a 20-way task under the 24-way name."""
    path, _ = _classes(tmp_path, [], {"猫": 2, "狗": 0, "鸟": 1})
    (path / "狗" / "notes.txt").write_text("not an image")
    with pytest.raises(TestSetError) as refused:
        load_classification_set(path, None)
    (problem,) = refused.value.problems
    assert problem.startswith(f"{path / '狗'}: an empty class folder (no ")
    assert problem.endswith("give its images, or remove the class")


def test_a_blank_line_in_the_class_names_is_refused_naming_the_line(tmp_path):
    """A blank line would shift every later class onto the next name: folder 002 scored as the
    class on line 4. Blank lines at the end shift nothing."""
    path, names = _classes(tmp_path, ["猫", "", "狗", "鸟"], {"000": 1, "001": 1, "002": 1})
    with pytest.raises(TestSetError) as refused:
        load_classification_set(path, names)
    assert refused.value.problems == [
        f"{names}:2: a blank line: class 1 has no name, and every class after it would be "
        f"scored under the name of the next; one name per line"
    ]
    names.write_text("猫\n狗\n鸟\n\n\n", "utf-8")
    assert load_classification_set(path, names).class_names == ["猫", "狗", "鸟"]


def test_class_names_without_images_are_refused_naming_each(tmp_path):
    """label_cn.txt names more classes than there are folders (a partial download, another
    set's names file): each class without images is named with its line."""
    path, names = _classes(tmp_path, ["猫", "狗", "鸟", "鱼"], {"000": 2, "002": 1})
    with pytest.raises(TestSetError) as refused:
        load_classification_set(path, names)
    assert refused.value.problems == [
        f"{path}: no images for 2 of the 4 classes of {names}: 1 (狗, line 2), 3 (鱼, line 4); "
        f"each class needs images (a partial download, or a class names file of another set?)"
    ]


def test_folder_names_are_the_class_names_without_a_names_file(tmp_path):
    for name in ("狗", "猫"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.jpg").write_bytes(_jpeg())
    (tmp_path / "猫" / "notes.txt").write_text("not an image")  # not an image suffix: ignored
    loaded = load_classification_set(tmp_path, None)
    assert loaded.class_names == ["狗", "猫"] and loaded.labels == [0, 1]


def test_a_tsv_of_image_and_label_with_paths_relative_to_it(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "1.jpg").write_bytes(_jpeg())
    (tmp_path / "img" / "2.png").write_bytes(_jpeg())
    tsv = tmp_path / "labels.tsv"
    tsv.write_text("img/1.jpg\t猫\nimg/2.png\t狗\n", "utf-8")
    loaded = load_classification_set(tsv, None)
    assert loaded.class_names == ["狗", "猫"] and loaded.labels == [1, 0]
    assert loaded.images == [tmp_path / "img" / "1.jpg", tmp_path / "img" / "2.png"]


def test_every_problem_of_a_classification_set_is_named(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "1.jpg").write_bytes(_jpeg())
    (tmp_path / "img" / "bad.jpg").write_bytes(b"not a jpeg")
    tsv = tmp_path / "labels.tsv"
    tsv.write_text("img/1.jpg\t7\nimg/none.jpg\t0\nimg/bad.jpg\t1\nno-tab\n", "utf-8")
    names = tmp_path / "label_cn.txt"
    names.write_text("猫\n狗\n", "utf-8")
    with pytest.raises(TestSetError) as refused:
        load_classification_set(tsv, names)
    assert refused.value.problems == [
        f"{tsv}:2: {tmp_path / 'img' / 'none.jpg'} not found",
        f"{tsv}:4: expected `image<TAB>label`",
        f"{tmp_path / 'img' / '1.jpg'}: label '7' is not a line number of {names} (0 to 1)",
        f"{tmp_path / 'img' / 'bad.jpg'}: not an image Pillow reads (not an image format "
        f"Pillow reads)",
    ]
    numbered = tmp_path / "numbered.tsv"
    numbered.write_text("img/1.jpg\t0\n", "utf-8")
    with pytest.raises(TestSetError, match="labels are numbers .*give the class names file"):
        load_classification_set(numbered, None)


def test_production_requires_flickr30k_cn_and_skips_the_others_where_missing(tmp_path, monkeypatch):
    """recipe: production lists Flickr30K-CN (data/test, required), COCO-CN, MUGE (text to
    image only) and ImageNet-CN (optional): missing, the optional ones are skipped, the
    required one is a problem before any model loads."""
    monkeypatch.chdir(tmp_path)
    suites = recipe_params("production").eval.suites
    assert [(s.name, s.kind, s.required) for s in suites] == [
        ("flickr30k-cn", "retrieval", True),
        ("coco-cn", "retrieval", False),
        ("muge", "retrieval", False),
        ("imagenet-cn", "zero-shot-classification", False),
    ]
    assert suites[2].directions == "t2i"
    loaded, skipped, problems = load_suites(suites)
    assert loaded == [] and list(skipped) == ["coco-cn", "muge", "imagenet-cn"]
    assert problems == [
        "eval.suites flickr30k-cn: data/test not found, and the suite is required (give its "
        "files there, or set required: false)"
    ]
    write_test_set(tmp_path / "data" / "test", [(i, _jpeg(), [f"图{i}"]) for i in range(3)])
    loaded, skipped, problems = load_suites(suites)
    assert [s.name for s in loaded] == ["flickr30k-cn"] and problems == []
    assert skipped["muge"] == "datasets/MUGE not found"


@pytest.mark.parametrize(
    "suites, said",
    [
        ([{"name": "a.b", "kind": "retrieval", "path": "x"}], "eval.suites[0].name: got 'a.b'"),
        ([{"name": "delta", "kind": "retrieval", "path": "x"}], "eval.suites[0].name"),
        ([{"kind": "retrieval", "path": "x"}], "eval.suites[0]: name is required"),
        ([{"name": "a", "kind": "cls", "path": "x"}], "eval.suites[0].kind: got 'cls'; allowed"),
        (
            [{"name": "a", "kind": "retrieval", "path": "x", "templates": "t.txt"}],
            "eval.suites[0].templates: only for kind zero-shot-classification",
        ),
        (
            [{"name": "a", "kind": "zero-shot-classification", "path": "x", "directions": "t2i"}],
            "eval.suites[0].directions: only for kind retrieval",
        ),
        ([{"name": "a", "kind": "retrieval", "path": "x"}] * 2, "two suites are named 'a'"),
        ([{"name": "a", "kind": "retrieval", "path": "x", "size": 1}], "[0].size: unknown key"),
        ([], "eval.suites: must list at least one test set"),
    ],
)
def test_a_bad_suite_entry_names_its_place_and_key(suites, said):
    with pytest.raises(ConfigError) as refused:
        resolve(EvalParams, {"eval": {"suites": suites}})
    assert said in str(refused.value)


def test_zero_shot_accuracy_by_hand():
    """Two prompts per class, averaged and normalised; top-1 and top-5 over three classes."""
    prompts = torch.tensor([[1.0, 0], [0.8, 0.6], [0, 1.0], [0, 1.0], [-1.0, 0], [-1.0, 0]])
    classes = class_embeddings(prompts, 2)
    torch.testing.assert_close(classes[0], torch.tensor([0.9, 0.3]) / math.hypot(0.9, 0.3))
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, -0.8], [-1.0, 0.0]])
    accuracy = zero_shot_accuracy(images, classes, [0, 1, 2, 0])  # right, right, wrong, wrong
    assert accuracy == {"top1": 50.0}  # top-5 over 3 classes would be 100: left out


def test_top_k_over_k_classes_or_fewer_is_left_out_not_100():
    features = torch.eye(6)
    assert set(zero_shot_accuracy(features, features, range(6))) == {"top1", "top5"}
    assert set(zero_shot_accuracy(features[:5], features[:5], range(5))) == {"top1"}
    with pytest.raises(ValueError, match="over 1 class"):
        zero_shot_accuracy(features[:1], features[:1], [0])


def test_a_text_to_image_only_set_reports_its_three_recalls_and_their_mean():
    images = torch.eye(3)
    texts = torch.eye(3)[[0, 2]]  # image 1 is a distractor no caption describes
    relevant = relevance_matrix([10, 11, 12], [_Caption((10,)), _Caption((12,))])
    metrics = retrieval_metrics(images, texts, relevant, "t2i")
    assert tuple(metrics) == T2I_KEYS and metrics["mean_recall"] == 100.0


class _Caption:
    def __init__(self, image_ids):
        self.image_ids = image_ids


def _retrieval_suite(tmp_path, described: list[list[int]], num_images: int, **keys):
    """A retrieval suite of `num_images` images and one caption per entry of `described`."""
    items = [(i, _jpeg((20 * i % 256, 40, 40)), []) for i in range(num_images)]
    write_test_set(tmp_path / "set", items)
    with open(tmp_path / "set" / "test_texts.jsonl", "w", encoding="utf-8") as texts:
        for n, ids in enumerate(described):
            texts.write(f'{{"text_id": {n}, "text": "图{n}", "image_ids": {ids}}}\n')
    config = {"name": "mine", "kind": "retrieval", "path": str(tmp_path / "set"), **keys}
    return resolve(EvalParams, {"eval": {"suites": [config]}}).eval.suites


def test_a_retrieval_suite_whose_captions_all_describe_one_image_is_refused(tmp_path):
    """image->text over one query scored R@1/5/10 = 100 and lifted the mean recall from 22.92
    to 72.50: refused, naming the direction and the remedy; scored text->image only it is fine."""
    suites = _retrieval_suite(tmp_path, [[0]] * 12, num_images=12)
    _, _, problems = load_suites(suites)
    where = f"eval.suites mine ({tmp_path / 'set'})"
    assert problems == [
        f"{where}: image->text has 1 query (images some caption describes): a recall over "
        f"fewer than 2 is 0 or 100 whatever the model",
        "eval.suites mine: its captions describe too few images to rank captions by image: set "
        "directions: t2i to score it text->image only, as MUGE is",
    ]
    suites = _retrieval_suite(tmp_path / "t2i", [[0]] * 12, num_images=12, directions="t2i")
    loaded, _, problems = load_suites(suites)
    assert problems == [] and loaded[0].flags() == {}


def test_a_retrieval_suite_of_one_image_measures_nothing_either_way(tmp_path):
    _, _, problems = load_suites(_retrieval_suite(tmp_path, [[0], [0]], num_images=1))
    assert problems[:2] == [
        f"eval.suites mine ({tmp_path / 'set'}): text->image ranks 1 image: fewer than 2, "
        f"every recall is 100 whatever the model",
        f"eval.suites mine ({tmp_path / 'set'}): image->text has 1 query (images some caption "
        f"describes): a recall over fewer than 2 is 0 or 100 whatever the model",
    ]
    assert problems[2].endswith(
        "give it more images and captions (test_imgs.tsv, test_texts.jsonl)"
    )


def test_a_direction_of_few_queries_is_flagged_and_said(tmp_path):
    """Seven images each with a caption, twelve captions: both directions score, each flagged
    with the counts that make its recalls coarse (recall@10 over 7 images is 100)."""
    described = [[i % 7] for i in range(12)]
    (suite,), _, problems = load_suites(_retrieval_suite(tmp_path, described, num_images=7))
    assert problems == []
    assert suite.flags() == {"t2i_few_candidates": 7, "i2t_few_queries": 7}
    where = f"suite mine ({tmp_path / 'set'})"
    assert suite.warnings() == [
        f"{where}: text->image ranks 7 images: recall@10 over fewer than 10 is 100 whatever the "
        f"model",
        f"{where}: image->text has 7 queries (images some caption describes): under 10, one "
        f"query moves each recall by over 10 points",
    ]


def test_recall_over_fewer_than_two_queries_is_never_computed():
    """The metric refuses what the suite checks refuse: no caller can get a recall of 100 over
    one query."""
    with pytest.raises(ValueError, match="recall over"):
        retrieval_metrics(torch.eye(3), torch.eye(3)[:1], torch.eye(3, dtype=torch.bool)[:1])


def test_suites_written_short_are_the_suites_with_those_keys_at_their_defaults():
    """eval.suites entries may leave keys out: the demo's suites written short are the embedded
    default's, and a list of one is that one suite."""
    short = [
        {"name": "test", "kind": "retrieval", "path": "data/test"},
        {
            "name": "t2i-distractors",
            "kind": "retrieval",
            "path": "data/suites/t2i-distractors",
            "directions": "t2i",
            "required": False,
        },
        {
            "name": "colour-shape",
            "kind": "zero-shot-classification",
            "path": "data/suites/colour-shape/test",
            "classes": "data/suites/colour-shape/label_cn.txt",
            "required": False,
        },
    ]
    assert resolve(EvalParams, {"eval": {"suites": short}}) == EvalParams()
    mine = {"eval": {"suites": short[:1]}}
    assert [s.name for s in resolve(EvalParams, mine).eval.suites] == ["test"]


def test_data_root_reads_the_suites_under_data_from_the_runs_data():
    """`--data-root /mnt/zh` (the run's data on a mounted volume, fab train --data): the suites
    under data/ are read there, every other path as given; no one-set fallback."""
    from clipforge.eval.stage import under_root

    assert under_root("data/test", "/mnt/zh") == "/mnt/zh/test"
    assert under_root("data/suites/colour-shape", "/mnt/zh") == "/mnt/zh/suites/colour-shape"
    assert under_root("/datasets/muge", "/mnt/zh") == "/datasets/muge"
    assert under_root("database/x", "/mnt/zh") == "database/x"  # a prefix, not the folder
