"""The eval stage on every suite of the demo (the builtin data's test set, its text-to-image set
with distractors and its zero-shot classification set), recomputed here by hand from embeddings
that plain open_clip gives, with a baseline, and with suites missing."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import open_clip
import pytest
import torch
from PIL import Image

from clipforge.eval.stage import main as eval_main
from clipforge.export.card import NOT_EVALUATED
from clipforge.export.local_dir import export_model
from clipforge.model.config import ModelConfig
from clipforge.model.factory import build_model
from tests.conftest import write_params

pytestmark = pytest.mark.slow

SUITES = ("test", "t2i-distractors", "colour-shape")
TEMPLATES = Path(__file__).parents[2] / "src" / "clipforge" / "eval" / "templates_zh.txt"


@pytest.fixture
def model_dir(untrained_model_dir) -> str:
    return f"local-dir:{untrained_model_dir}"


def _other_model(path: Path) -> str:
    """A second random clipforge-tiny, another seed: a baseline that differs from the model."""
    torch.manual_seed(1)
    bundle = build_model(ModelConfig(image_size=32))
    export_model(bundle.model.state_dict(), bundle.model_cfg, bundle.preprocess_cfg, "", path)
    return f"local-dir:{path}"


def _by_hand(spec: str) -> dict:
    """The demo suites' metrics from open_clip's embeddings, counted in plain Python."""
    model, _, preprocess = open_clip.create_model_and_transforms(spec)
    tokenizer = open_clip.get_tokenizer(spec)
    model.eval()

    def images(files):
        pixels = torch.stack([preprocess(Image.open(f).convert("RGB")) for f in files])
        with torch.no_grad():
            return model.encode_image(pixels, normalize=True)

    def texts(lines):
        with torch.no_grad():
            return model.encode_text(tokenizer(lines), normalize=True)

    def recall(directory: Path, both: bool) -> dict:
        rows = [x.split("\t") for x in (directory / "test_imgs.tsv").read_text().splitlines()]
        ids = [int(i) for i, _ in rows]
        image_features = images(io.BytesIO(base64.b64decode(b)) for _, b in rows)
        captions = [
            json.loads(x)
            for x in (directory / "test_texts.jsonl").read_text("utf-8").split("\n")
            if x
        ]
        similarity = texts([c["text"] for c in captions]) @ image_features.T
        out = {}
        for k in (1, 5, 10):
            hits = [
                any(ids[i] in c["image_ids"] for i in similarity[t].argsort(descending=True)[:k])
                for t, c in enumerate(captions)
            ]
            out[f"t2i_r{k:02d}"] = 100 * sum(hits) / len(hits)
        if both:
            for k in (1, 5, 10):
                hits = [
                    any(
                        ids[i] in captions[t]["image_ids"]
                        for t in similarity[:, i].argsort(descending=True)[:k]
                    )
                    for i in range(len(ids))
                    if any(ids[i] in c["image_ids"] for c in captions)
                ]
                out[f"i2t_r{k:02d}"] = 100 * sum(hits) / len(hits)
        out["mean_recall"] = sum(out.values()) / len(out)
        return out

    root = Path("data/suites/colour-shape")
    names = (root / "label_cn.txt").read_text("utf-8").split()
    files = sorted((root / "test").glob("*/*.jpg"))
    labels = [int(f.parent.name) for f in files]
    prompts = [t for t in TEMPLATES.read_text("utf-8").splitlines() if t and not t.startswith("#")]
    classes = []
    for name in names:
        mean = texts([p.replace("{}", name) for p in prompts]).mean(dim=0)
        classes.append(mean / mean.norm())
    scores = images(files) @ torch.stack(classes).T
    ranked = [scores[n].argsort(descending=True).tolist() for n in range(len(files))]
    top = {k: 100 * sum(y in r[:k] for y, r in zip(labels, ranked)) / len(files) for k in (1, 5)}
    return {
        "test": recall(Path("data/test"), both=True),
        "t2i-distractors": recall(Path("data/suites/t2i-distractors"), both=False),
        "colour-shape": {"top1": top[1], "top5": top[5]},
    }


def _approx(metrics: dict) -> dict:
    return {name: pytest.approx(values, abs=1e-4) for name, values in metrics.items()}


def test_every_demo_suite_is_scored_as_counted_by_hand(workdir, model_dir, capsys):
    """metrics/eval.json: each suite under its name (recall in its directions, or top-1/top-5),
    their mean (mean_recall, mean_recall, top1), equal to what this test counts itself."""
    assert eval_main(["--params", "params.yaml", "--model", model_dir]) == 0
    metrics = json.loads(Path("metrics/eval.json").read_text())
    assert list(metrics) == [*SUITES, "mean_over_suites"]
    expected = _by_hand(model_dir)
    assert {k: metrics[k] for k in SUITES} == _approx(expected)
    headlines = [expected["test"]["mean_recall"], expected["t2i-distractors"]["mean_recall"]]
    headlines.append(expected["colour-shape"]["top1"])
    assert metrics["mean_over_suites"] == pytest.approx(sum(headlines) / 3, abs=1e-4)
    info = json.loads(Path("metrics/eval.info.json").read_text())
    assert info["suites"]["colour-shape"] == {
        "kind": "zero-shot-classification",
        "path": "data/suites/colour-shape/test",
        "num_images": 24,
        "num_classes": 24,
        "num_templates": 16,
        "decontamination": info["suites"]["colour-shape"]["decontamination"],
    }
    assert info["suites"]["t2i-distractors"]["num_texts"] == 12  # every other image described
    assert info["skipped"] == {}
    table = capsys.readouterr().out
    assert all(name in table for name in (*SUITES, "top1", "mean_over_suites"))


def test_the_documented_line_evaluates_the_export_in_models_clip(workdir, untrained_model_dir):
    """docs/pipeline.md's `python -m clipforge.eval --model local-dir:models/clip --out
    metrics/eval.json`, word for word, where the train stage leaves its export: every suite."""
    shutil.copytree(untrained_model_dir, "models/clip")
    assert eval_main(["--model", "local-dir:models/clip", "--out", "metrics/eval.json"]) == 0
    assert list(json.loads(Path("metrics/eval.json").read_text())) == [*SUITES, "mean_over_suites"]


def test_the_baseline_is_scored_on_every_suite_with_the_deltas(workdir, model_dir, tmp_path):
    """eval.baseline_model: its metrics in the same layout under `baseline` (what it scores
    alone), and model minus baseline under `delta`, key by key and for the mean."""
    baseline = _other_model(tmp_path / "other")
    write_params(Path("params.yaml"), {"eval": {"baseline_model": baseline}})
    assert eval_main(["--params", "params.yaml", "--model", model_dir]) == 0
    metrics = json.loads(Path("metrics/eval.json").read_text())
    assert eval_main(["--params", "params.yaml", "--model", baseline, "--out", "alone.json"]) == 0
    alone = json.loads(Path("alone.json").read_text())
    assert metrics["baseline"] == {k: v for k, v in alone.items() if k not in ("baseline", "delta")}
    for name in SUITES:
        for key, value in metrics[name].items():
            assert metrics["delta"][name][key] == value - metrics["baseline"][name][key]
    assert metrics["delta"]["mean_over_suites"] == (
        metrics["mean_over_suites"] - metrics["baseline"]["mean_over_suites"]
    )
    assert metrics["test"] != metrics["baseline"]["test"]  # two models, two results


def test_a_missing_optional_suite_is_one_line_and_a_missing_required_one_stops_the_stage(
    workdir, model_dir, capsys, caplog
):
    """An optional suite whose files are not there: skipped, said in one line, listed in
    eval.info.json. A required one: exit 2 before any model loads, one line naming it, nothing
    written. A user's own classification .tsv with their own templates is scored."""
    images = Path("mine")
    images.mkdir()
    for n, path in enumerate(sorted(Path("data/suites/colour-shape/test").glob("*/*.jpg"))[:6]):
        (images / f"{n}.jpg").write_bytes(path.read_bytes())
        with open(images / "labels.tsv", "a", encoding="utf-8") as f:
            f.write(f"{n}.jpg\t{['红色的圆形', '蓝色的方块'][n % 2]}\n")
    (images / "prompts.txt").write_text("图中只有一个{}\n{}\n", "utf-8")
    own = {
        "name": "mine",
        "kind": "zero-shot-classification",
        "path": "mine/labels.tsv",
        "templates": "mine/prompts.txt",
    }
    missing = {"name": "coco-cn", "kind": "retrieval", "path": "datasets/COCO-CN"}
    write_params(Path("params.yaml"), {"eval": {"suites": [own, {**missing, "required": False}]}})
    assert eval_main(["--params", "params.yaml", "--model", model_dir]) == 0
    assert [r.getMessage() for r in caplog.records if "coco-cn" in r.getMessage()] == [
        "suite coco-cn skipped (optional): datasets/COCO-CN not found"
    ]
    metrics = json.loads(Path("metrics/eval.json").read_text())
    assert list(metrics) == ["mine", "mean_over_suites"]
    assert set(metrics["mine"]) == {"top1"}  # top-5 of 2 classes would be 100: left out
    info = json.loads(Path("metrics/eval.info.json").read_text())
    assert info["skipped"] == {"coco-cn": "datasets/COCO-CN not found"}
    assert (
        info["suites"]["mine"]["num_classes"] == 2 and info["suites"]["mine"]["num_templates"] == 2
    )

    Path("metrics/eval.json").unlink()
    capsys.readouterr()
    write_params(Path("params.yaml"), {"eval": {"suites": [own, missing]}})
    assert eval_main(["--params", "params.yaml", "--model", model_dir]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "clipforge.eval: error: eval.suites coco-cn: datasets/COCO-CN not found, and the suite "
        "is required (give its files there, or set required: false)"
    ]
    assert not Path("metrics/eval.json").exists()


def test_each_image_is_encoded_once_per_suite_in_batches(workdir, model_dir):
    """The classification suite's 24 images pass through the image tower once, in batches of
    eval.batch_size (10 here: 10, 10, 4), however many classes and prompts there are."""
    from clipforge.eval.config import SuiteConfig
    from clipforge.eval.core import score_suite
    from clipforge.eval.suites import load_suite
    from clipforge.export.loading import load_open_clip

    model, preprocess, tokenizer = load_open_clip(model_dir, None, "cpu")
    batches = []
    encode_image = model.encode_image

    def counted(pixels, **kwargs):
        batches.append(len(pixels))
        return encode_image(pixels, **kwargs)

    model.encode_image = counted
    suite = load_suite(
        SuiteConfig(
            name="colour-shape",
            kind="zero-shot-classification",
            path="data/suites/colour-shape/test",
            classes="data/suites/colour-shape/label_cn.txt",
        )
    )
    assert set(score_suite(model, preprocess, tokenizer, suite, 10, "cpu")) == {"top1", "top5"}
    assert batches == [10, 10, 4]


# -- inputs that gave a trivial or shifted number with exit 0 --------------------------------------
COLOUR_SHAPE = Path("data/suites/colour-shape")


def _one_class(root: Path) -> None:
    """label_cn.txt of one class, and its folder only (top-1 was 100.00)."""
    names = (root / "label_cn.txt").read_text("utf-8").splitlines()
    (root / "label_cn.txt").write_text(names[0] + "\n", "utf-8")
    for folder in sorted((root / "test").iterdir())[1:]:
        shutil.rmtree(folder)


def _four_empty_folders(root: Path) -> None:
    """4 of the 24 class folders emptied (scored as a 20-way task: top-1 10.00, not 5.00)."""
    for folder in sorted((root / "test").iterdir())[3:7]:
        for image in folder.iterdir():
            image.unlink()


def _blank_line(root: Path) -> None:
    """A blank line before line 3: folder 003 (红色的十字形) was scored as 橙色的圆形."""
    names = (root / "label_cn.txt").read_text("utf-8").splitlines()
    (root / "label_cn.txt").write_text("\n".join([*names[:2], "", *names[2:]]) + "\n", "utf-8")


def _one_image_described(root: Path) -> None:
    """Every caption of the test set on one image: image->text was R@1/5/10 = 100 over one
    query, and mean_recall 72.50 against 22.92."""
    lines = (root / "test_texts.jsonl").read_text("utf-8").splitlines()
    first = json.loads(lines[0])["image_ids"]
    captions = [{**json.loads(line), "image_ids": first} for line in lines]
    text = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in captions)
    (root / "test_texts.jsonl").write_text(text, "utf-8")


@pytest.mark.parametrize(
    "damage, where, said",
    [
        (_one_class, COLOUR_SHAPE / "label_cn.txt", "only 1 class: a zero-shot classification"),
        (_four_empty_folders, COLOUR_SHAPE / "test" / "003", "an empty class folder"),
        (_blank_line, COLOUR_SHAPE / "label_cn.txt", "3: a blank line: class 2 has no name"),
        (_one_image_described, "eval.suites test (data/test)", "image->text has 1 query"),
    ],
)
def test_a_suite_that_would_score_a_trivial_or_shifted_number_stops_the_stage(
    workdir, model_dir, capsys, damage, where, said
):
    """Each is refused before any model loads, naming the file, the line or the folder, with
    exit 2 and no eval.json: none is scored 100 (or another task's number) with exit 0."""
    damage(Path("data/test") if damage is _one_image_described else COLOUR_SHAPE)
    assert eval_main(["--params", "params.yaml", "--model", model_dir]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert any(
        line.startswith(f"clipforge.eval: error: {where}") and said in line for line in errors
    )
    assert not Path("metrics").exists()


def test_a_direction_of_few_queries_is_flagged_in_eval_json_and_the_card(
    workdir, untrained_model_dir, tmp_path, caplog
):
    """Seven images, each with a caption: scored, with a warning and its counts beside its
    recalls in eval.json and the model card (t2i over 7 images: R@10 is 100 for any model)."""
    from clipforge.data.testset import load_test_set, write_test_set

    test = load_test_set(Path("data/test"))
    seven = [(i, test.images[i], [f"第{i}张图"]) for i in range(7)]
    write_test_set(Path("seven"), seven)
    shutil.copytree(untrained_model_dir, tmp_path / "clip")
    (tmp_path / "clip" / "README.md").write_text(f"## Metrics\n{NOT_EVALUATED}\n", "utf-8")
    suite = {"name": "seven", "kind": "retrieval", "path": "seven"}
    write_params(Path("params.yaml"), {"eval": {"suites": [suite]}})
    assert eval_main(["--params", "params.yaml", "--model", f"local-dir:{tmp_path / 'clip'}"]) == 0
    metrics = json.loads(Path("metrics/eval.json").read_text())["seven"]
    flags = {
        "t2i_few_queries": 7,
        "t2i_few_candidates": 7,
        "i2t_few_queries": 7,
        "i2t_few_candidates": 7,
    }
    assert {k: metrics[k] for k in flags} == flags
    assert metrics["t2i_r10"] == 100.0  # why it is flagged
    card = Path("metrics/model-card.md").read_text("utf-8")
    assert "t2i_few_candidates 7" in card and "i2t_few_queries 7" in card
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert (
        "suite seven (seven): text->image ranks 7 images: recall@10 over fewer than 10 is 100 "
        "whatever the model (flagged in metrics/eval.json)" in warnings
    )
