"""Every test set is checked whole before anything is encoded: a wrong one stops the eval stage
(and the data stage's data.test_dir) with one line per problem naming the file, the line and the
id, exit code 2, and nothing written. Before, a duplicated id gave a slightly wrong recall with
exit 0, an unknown id a 21-line KeyError, empty files a torch.cat error."""

from __future__ import annotations

import base64
import io
import json
import shutil

import pytest
from PIL import Image

from clipforge.data.stage import main as data_main
from clipforge.data.testset import IMAGES_FILE, TEXTS_FILE, load_test_set
from clipforge.eval.stage import main as eval_main
from tests.conftest import write_params


def _image(colour: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (colour, 0, 0)).save(buffer, format="JPEG")
    return buffer.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _text(text_id, image_ids, text="一只猫") -> str:
    return json.dumps(
        {"text_id": text_id, "text": text, "image_ids": image_ids}, ensure_ascii=False
    )


GOOD_IMAGES = [f"{i}\t{_b64(_image(40 * i))}" for i in range(3)]
GOOD_TEXTS = [_text(i, [i]) for i in range(3)]

# case -> (test_imgs.tsv lines, test_texts.jsonl lines, the lines a user sees)
BAD_SETS = {
    "an image line given twice": (
        [*GOOD_IMAGES, GOOD_IMAGES[1]],
        GOOD_TEXTS,
        ["{imgs}:4: image id 1 again (the same image; first on line 2): ids must be unique"],
    ),
    "an image id reused for another image": (
        [*GOOD_IMAGES, f"2\t{_b64(_image(250))}"],
        GOOD_TEXTS,
        ["{imgs}:4: image id 2 again (a different image; first on line 3): ids must be unique"],
    ),
    "a caption of an unknown image": (
        GOOD_IMAGES,
        [*GOOD_TEXTS, _text(3, [0, 7])],
        ["{texts}:4: text id 3 refers to image id 7, which test_imgs.tsv does not have"],
    ),
    "empty files": ([], [], ["{imgs}: empty: no images", "{texts}: empty: no captions"]),
    "a caption id given twice": (
        GOOD_IMAGES,
        [*GOOD_TEXTS, _text(1, [2], "又一只猫")],
        ["{texts}:4: text id 1 again (first on line 2): ids must be unique"],
    ),
    "a caption without images": (
        GOOD_IMAGES,
        [*GOOD_TEXTS, _text(3, [])],
        ["{texts}:4: text id 3: lists no image ids, so it has no right answer"],
    ),
    "an image that does not decode, and one that is not base64": (
        [GOOD_IMAGES[0], f"1\t{_b64(b'GIF89a but not really')}", "2\tnot*base64", GOOD_IMAGES[2]],
        GOOD_TEXTS[::2],
        [
            "{imgs}:2: image id 1: not a decodable image (not an image format Pillow reads)",
            "{imgs}:3: image id 2: not base64 (Only base64 data is allowed)",
        ],
    ),
    "malformed lines": (
        [*GOOD_IMAGES, "3 has no tab", "x\t" + _b64(_image(1))],
        [*GOOD_TEXTS, '{"text_id": 3, "text": "猫"}', "not json"],
        [
            "{imgs}:4: expected `image_id<TAB>base64`",
            "{imgs}:5: image id 'x' is not an integer",
            '{texts}:4: expected {{"text_id": int, "text": str, "image_ids": [int, ...]}}',
            '{texts}:5: expected {{"text_id": int, "text": str, "image_ids": [int, ...]}}',
        ],
    ),
}


def _write_set(directory, images: list[str], texts: list[str]):
    directory.mkdir(parents=True)
    (directory / IMAGES_FILE).write_text("".join(line + "\n" for line in images))
    (directory / TEXTS_FILE).write_text("".join(line + "\n" for line in texts), "utf-8")
    return directory


def _expected(lines: list[str], directory, prefix: str) -> str:
    files = {"imgs": directory / IMAGES_FILE, "texts": directory / TEXTS_FILE}
    return "".join(f"{prefix}{line.format(**files)}\n" for line in lines)


@pytest.mark.parametrize("case", sorted(BAD_SETS))
def test_eval_refuses_a_bad_test_set_before_encoding(case, tmp_path, untrained_model_dir, capsys):
    images, texts, lines = BAD_SETS[case]
    test_dir = _write_set(tmp_path / "test", images, texts)
    params = write_params(tmp_path / "params.yaml")
    out = tmp_path / "metrics" / "eval.json"
    argv = ["--params", str(params), "--model", f"local-dir:{untrained_model_dir}"]
    assert eval_main([*argv, "--data", str(test_dir), "--out", str(out)]) == 2
    assert capsys.readouterr().err == _expected(lines, test_dir, "clipforge.eval: error: ")
    assert not (tmp_path / "metrics").exists()


def test_the_data_stage_refuses_a_bad_test_dir_and_keeps_the_old_data(tmp_path, small_data, capsys):
    images, texts, lines = BAD_SETS["an image id reused for another image"]
    test_dir = _write_set(tmp_path / "flickr", images, texts)
    shutil.copytree(small_data, tmp_path / "data")
    before = (tmp_path / "data" / "manifest.json").read_bytes()
    params = write_params(tmp_path / "params.yaml", {"data": {"test_dir": str(test_dir)}})
    assert data_main(["--params", str(params), "--out", str(tmp_path / "data")]) == 2
    assert capsys.readouterr().err == _expected(
        lines, test_dir, "clipforge.data: error: data.test_dir: "
    )
    assert (tmp_path / "data" / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "flickr", "params.yaml"]


def test_a_good_test_set_loads_whole(tmp_path):
    test_set = load_test_set(_write_set(tmp_path / "test", GOOD_IMAGES, GOOD_TEXTS))
    assert test_set.image_ids == [0, 1, 2] and [t.image_ids for t in test_set.texts] == [
        (0,),
        (1,),
        (2,),
    ]


def test_a_long_list_of_problems_is_cut_with_a_count(tmp_path, untrained_model_dir, capsys):
    test_dir = _write_set(tmp_path / "test", GOOD_IMAGES, [_text(i, [99]) for i in range(30)])
    params = write_params(tmp_path / "params.yaml")
    argv = ["--params", str(params), "--model", f"local-dir:{untrained_model_dir}"]
    assert eval_main([*argv, "--data", str(test_dir), "--out", str(tmp_path / "e.json")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 21 and lines[-1] == "clipforge.eval: error: ... and 10 more problems"
