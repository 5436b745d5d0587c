"""The data stage: shards, manifest, Chinese-CLIP test layout, bad input, atomic replacement."""

from __future__ import annotations

import base64
import io
import json
import tarfile

import pytest
from PIL import Image

from clipforge.data.stage import main
from clipforge.data.testset import check_test_set, read_texts
from clipforge.fsutil import sha256_file
from tests.conftest import write_params


def _jpeg(size=(16, 16), colour=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="JPEG")
    return buffer.getvalue()


def test_builtin_source_writes_shards_manifest_and_test_layout(small_data):
    manifest = json.loads((small_data / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    assert train["count"] == 192 and len(train["shards"]) == 4  # 50 per shard
    for shard in train["shards"]:
        path = small_data / shard["name"]
        assert sha256_file(path) == shard["sha256"]
        with tarfile.open(path) as tar:
            names = tar.getnames()
        assert len(names) == 2 * shard["count"]
        assert {n.split(".", 1)[1] for n in names} == {"jpg", "txt"}
    counts = check_test_set(small_data / "test")
    assert counts == {"images": 24, "texts": 48}
    first = json.loads((small_data / "test" / "test_texts.jsonl").read_text().splitlines()[0])
    assert set(first) == {"text_id", "text", "image_ids"} and isinstance(first["image_ids"], list)
    image_id, payload = (
        (small_data / "test" / "test_imgs.tsv").read_text().splitlines()[0].split("\t")
    )
    Image.open(io.BytesIO(base64.b64decode(payload))).verify()
    assert (small_data / "config.yaml").is_file()


def test_builtin_shards_are_byte_for_byte_reproducible(tmp_path, small_data):
    params = write_params(tmp_path / "params.yaml")
    assert main(["--params", str(params), "--out", str(tmp_path / "again")]) == 0
    first = json.loads((small_data / "manifest.json").read_text())
    again = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert first == again


@pytest.fixture
def messy_folder(tmp_path):
    """A local JSONL source with one of each kind of bad item, plus good ones."""
    root = tmp_path / "src"
    root.mkdir()
    good = []
    for i in range(12):
        (root / f"good{i}.jpg").write_bytes(_jpeg(colour=(i * 20, 100, 50)))
        good.append({"image": f"good{i}.jpg", "caption": f"第{i}张图片，一只猫"})
    good.append(
        {"image": "good0.jpg", "caption": "同一张图片的第二条描述"}
    )  # two captions, one image
    (root / "empty.jpg").write_bytes(b"")
    (root / "corrupt.jpg").write_bytes(b"this is not an image at all")
    (root / "truncated.jpg").write_bytes(_jpeg(size=(64, 64))[:200])
    buffer = io.BytesIO()
    Image.new("1", (9000, 9000)).save(buffer, format="PNG")  # 81 Mpx, a few KB on disk
    (root / "huge.png").write_bytes(buffer.getvalue())
    bad = [
        {"image": "missing.jpg", "caption": "不存在的文件"},
        {"image": "empty.jpg", "caption": "空文件"},
        {"image": "corrupt.jpg", "caption": "损坏的图片"},
        {"image": "truncated.jpg", "caption": "截断的图片"},
        {"image": "huge.png", "caption": "巨大的图片"},
        {"image": "good1.jpg", "caption": "   \t "},
        {"image": "good2.jpg", "caption": ""},
    ]
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in good + bad]
    lines.append(b'{"image": "good3.jpg", "caption": "\xff\xfe not utf-8"}')
    lines.append(b"{not json")
    (root / "pairs.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return root / "pairs.jsonl"


def test_local_source_skips_every_kind_of_bad_item_by_reason(tmp_path, messy_folder):
    params = write_params(
        tmp_path / "params.yaml",
        {
            "data": {
                "source": "local",
                "path": str(messy_folder),
                "val_fraction": 0.2,
                "test_fraction": 0.2,
                "max_image_pixels": 50_000_000,
            }
        },
    )
    assert main(["--params", str(params), "--out", str(tmp_path / "data")]) == 0
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["skipped"]["counts"] == {
        "bad_record": 1,
        "caption_not_utf8": 1,
        "corrupt_image": 2,
        "empty_caption": 2,
        "empty_file": 1,
        "missing_file": 1,
        "too_large": 1,
    }
    splits = manifest["splits"]
    kept = splits["train"]["count"] + splits["val"]["count"] + splits["test"]["texts"]
    assert kept == 13  # 12 good images, one of them with a second caption


def test_local_source_keeps_all_captions_of_a_test_image_together(tmp_path, messy_folder):
    """Splits are decided per image, so both captions of good0.jpg land on one test image."""
    from clipforge.data.local import split_of

    image = messy_folder.parent / "good0.jpg"
    seed = next(s for s in range(1000) if split_of(image, s, 0.2, 0.3) == "test")
    params = write_params(
        tmp_path / "params.yaml",
        {
            "data": {
                "source": "local",
                "path": str(messy_folder),
                "val_fraction": 0.2,
                "test_fraction": 0.3,
                "seed": seed,
            }
        },
    )
    out = tmp_path / "data"
    assert main(["--params", str(params), "--out", str(out)]) == 0
    texts = read_texts(out / "test")
    ids = {t.image_ids for t in texts if t.text in ("第0张图片，一只猫", "同一张图片的第二条描述")}
    assert len(ids) == 1 and len(next(iter(ids))) == 1


def test_missing_source_path_is_a_clear_error_and_old_data_survives(tmp_path, small_data, capsys):
    out = tmp_path / "data"
    import shutil

    shutil.copytree(small_data, out)
    before = sha256_file(out / "manifest.json")
    params = write_params(
        tmp_path / "params.yaml", {"data": {"source": "local", "path": str(tmp_path / "nope")}}
    )
    assert main(["--params", str(params), "--out", str(out)]) == 2
    assert "data.path:" in capsys.readouterr().err
    assert sha256_file(out / "manifest.json") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "params.yaml"]


def test_interrupted_stage_leaves_previous_outputs_intact(tmp_path, small_data, monkeypatch):
    """A crash mid-way (here: while writing the val split) keeps the old data/ and no debris."""
    import shutil

    import clipforge.data.stage as stage

    out = tmp_path / "data"
    shutil.copytree(small_data, out)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    real_write = stage.write_shards

    def crash_on_val(pairs, root, split, per_shard):
        if split == "val":
            raise KeyboardInterrupt
        return real_write(pairs, root, split, per_shard)

    monkeypatch.setattr(stage, "write_shards", crash_on_val)
    params = write_params(tmp_path / "params.yaml")
    with pytest.raises(KeyboardInterrupt):
        main(["--params", str(params), "--out", str(out)])
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "params.yaml"]


def test_test_dir_is_validated_and_copied(tmp_path, small_data):
    params = write_params(
        tmp_path / "params.yaml", {"data": {"test_dir": str(small_data / "test")}}
    )
    assert main(["--params", str(params), "--out", str(tmp_path / "data")]) == 0
    assert check_test_set(tmp_path / "data" / "test") == {"images": 24, "texts": 48}
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "test_imgs.tsv").write_text("1\tAAAA\n")
    (broken / "test_texts.jsonl").write_text('{"text_id": 0, "text": "x", "image_ids": [7]}\n')
    params = write_params(tmp_path / "params.yaml", {"data": {"test_dir": str(broken)}})
    assert main(["--params", str(params), "--out", str(tmp_path / "data2")]) == 2
    assert not (tmp_path / "data2").exists()


def test_folder_and_csv_sources_read_the_same_pairs(tmp_path):
    """A folder of images with same-named .txt captions, and a CSV of image,caption, give the
    same training data; a folder image without a caption file is skipped as missing_caption."""
    folder = tmp_path / "folder"
    folder.mkdir()
    rows = ["image,caption"]
    for i in range(6):
        (folder / f"{i}.jpg").write_bytes(_jpeg(colour=(40 * i, 90, 90)))
        (folder / f"{i}.txt").write_text(f"第{i}只狗在草地上", encoding="utf-8")
        rows.append(f'{i}.jpg,"第{i}只狗在草地上"')
    (folder / "orphan.jpg").write_bytes(_jpeg())
    (folder / "pairs.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    manifests = {}
    for name, path in (("folder", folder), ("csv", folder / "pairs.csv")):
        params = write_params(
            tmp_path / f"{name}.yaml",
            {
                "data": {
                    "source": "local",
                    "path": str(path),
                    "val_fraction": 0.0,
                    "test_fraction": 0.0,
                }
            },
        )
        assert main(["--params", str(params), "--out", str(tmp_path / f"data-{name}")]) == 0
        manifests[name] = json.loads((tmp_path / f"data-{name}" / "manifest.json").read_text())
    assert manifests["folder"]["skipped"]["counts"] == {"missing_caption": 1}
    assert manifests["csv"]["skipped"]["counts"] == {}
    assert manifests["folder"]["splits"]["train"]["count"] == 6
    assert [s["sha256"] for s in manifests["folder"]["splits"]["train"]["shards"]] == [
        s["sha256"] for s in manifests["csv"]["splits"]["train"]["shards"]
    ]


def test_csv_without_the_expected_columns_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "bad.csv").write_text("path,text\na.jpg,x\n", encoding="utf-8")
    params = write_params(
        tmp_path / "params.yaml", {"data": {"source": "local", "path": str(tmp_path / "bad.csv")}}
    )
    assert main(["--params", str(params), "--out", str(tmp_path / "data")]) == 2
    assert "columns `image` and `caption`" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_source_inside_the_output_directory_is_refused(tmp_path, capsys):
    """The stage replaces its output directory: a source inside it would be destroyed."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "pairs.jsonl").write_text("")
    params = write_params(
        tmp_path / "params.yaml",
        {"data": {"source": "local", "path": str(tmp_path / "data" / "pairs.jsonl")}},
    )
    assert main(["--params", str(params), "--out", str(tmp_path / "data")]) == 2
    assert "inside the output directory" in capsys.readouterr().err
    assert (tmp_path / "data" / "pairs.jsonl").exists()
