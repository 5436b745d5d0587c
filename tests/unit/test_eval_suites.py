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
    write_classification_set(tmp_path / "set", names, [(2, _jpeg()), (0, _jpeg()), (2, _jpeg())])
    assert sorted(p.name for p in (tmp_path / "set" / "test").iterdir()) == ["000", "002"]
    loaded = load_classification_set(tmp_path / "set" / "test", tmp_path / "set" / "label_cn.txt")
    assert loaded.class_names == names  # a class without images is still a candidate
    assert sorted(loaded.labels) == [0, 2, 2] and len(loaded.images) == 3


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
    assert accuracy == {"top1": 50.0, "top5": 100.0}


def test_a_text_to_image_only_set_reports_its_three_recalls_and_their_mean():
    images = torch.eye(3)
    texts = torch.eye(3)[[0, 2]]  # image 1 is a distractor no caption describes
    relevant = relevance_matrix([10, 11, 12], [_Caption((10,)), _Caption((12,))])
    metrics = retrieval_metrics(images, texts, relevant, "t2i")
    assert tuple(metrics) == T2I_KEYS and metrics["mean_recall"] == 100.0


class _Caption:
    def __init__(self, image_ids):
        self.image_ids = image_ids


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
