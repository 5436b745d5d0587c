"""The data stage: shards, manifest, Chinese-CLIP test layout, bad input, atomic replacement."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from clipforge.data.stage import main
from clipforge.data.testset import check_test_set, load_test_set
from clipforge.fsutil import sha256_file
from tests.conftest import subprocess_env, write_params
from tests.support.wait import still_running, wait_for


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
                "val_fraction": 0.0,  # 12 good images: too few for held-out splits
                "test_fraction": 0.0,
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


def _local_run(tmp_path, path: Path, **data) -> dict:
    """The data stage on a local source, nothing held out; its manifest's skip counts."""
    local = {"source": "local", "path": str(path), "val_fraction": 0.0, "test_fraction": 0.0}
    params = write_params(tmp_path / "params.yaml", {"data": {**local, **data}})
    assert main(["--params", str(params), "--out", str(tmp_path / "data")]) == 0
    return json.loads((tmp_path / "data" / "manifest.json").read_text())["skipped"]["counts"]


def test_local_files_over_the_limits_are_skipped_by_their_size(tmp_path):
    """A folder source's image over data.max_image_bytes and caption file over 4 bytes a
    character of data.max_caption_chars are skipped by their size, before being read."""
    root = tmp_path / "src"
    root.mkdir()
    for i in range(4):
        (root / f"{i}.jpg").write_bytes(_jpeg(colour=(40 * i, 10, 10)))
        (root / f"{i}.txt").write_text(f"第{i}张", "utf-8")
    (root / "big.jpg").write_bytes(_jpeg(size=(400, 400)))  # ~3 KB of JPEG
    (root / "big.txt").write_text("大图", "utf-8")
    (root / "long.jpg").write_bytes(_jpeg(colour=(1, 2, 3)))
    (root / "long.txt").write_text("长" * 30, "utf-8")  # 90 bytes: over 4 x 20
    counts = _local_run(tmp_path, root, max_image_bytes=2000, max_caption_chars=20)
    assert counts == {"too_large": 1, "caption_too_long": 1}


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_pairs_line_too_long_to_be_a_pair_is_read_past_as_a_bad_record(tmp_path, suffix):
    """A .jsonl or .csv line longer than a caption and a path can be (4 bytes a character of
    data.max_caption_chars, plus 64 KiB) is skipped in chunks, never held; the lines after it
    are read as usual (in a .csv, a field over csv's limit raised before)."""
    root = tmp_path / "src"
    root.mkdir()
    for i in range(3):
        (root / f"{i}.jpg").write_bytes(_jpeg(colour=(40 * i, 10, 10)))
    huge = "长" * 200_000  # 600 KB
    if suffix == ".jsonl":
        lines = [
            json.dumps({"image": f"{i}.jpg", "caption": c}, ensure_ascii=False)
            for i, c in ((0, "第一"), (1, huge), (2, "第三"))
        ]
        text = "\n".join(lines) + "\n"
    else:
        text = f"image,caption\n0.jpg,第一\n1.jpg,{huge}\n2.jpg,第三\n"
    (root / f"pairs{suffix}").write_text(text, "utf-8")
    assert _local_run(tmp_path, root / f"pairs{suffix}") == {"bad_record": 1}
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["count"] == 2


def test_local_source_keeps_all_captions_of_a_test_image_together(tmp_path, messy_folder):
    """Splits are decided per image, so both captions of good0.jpg land on one test image."""
    from clipforge.data.local import split_of

    images = [messy_folder.parent / f"good{i}.jpg" for i in range(12)]

    def tested(seed: int) -> list[bool]:
        return [split_of(image, seed, 0.0, 0.3) == "test" for image in images]

    # good0 among at least two test images (the split is a hash of the path: tmp_path moves it)
    seed = next(s for s in range(1000) if tested(s)[0] and sum(tested(s)) >= 2)
    params = write_params(
        tmp_path / "params.yaml",
        {
            "data": {
                "source": "local",
                "path": str(messy_folder),
                "val_fraction": 0.0,
                "test_fraction": 0.3,
                "seed": seed,
            }
        },
    )
    out = tmp_path / "data"
    assert main(["--params", str(params), "--out", str(out)]) == 0
    texts = load_test_set(out / "test").texts
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

    def crash_on_val(pairs, root, split, per_shard, tokenize):
        if split == "val":
            raise KeyboardInterrupt
        return real_write(pairs, root, split, per_shard, tokenize)

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


def _pairs_file(root, rows: list[tuple[str, str]]):
    lines = [
        json.dumps({"image": image, "caption": caption}, ensure_ascii=False)
        for image, caption in rows
    ]
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root / "pairs.jsonl"


def _local_params(tmp_path, path, **data):
    values = {"source": "local", "path": str(path), "val_fraction": 0.0, "test_fraction": 0.0}
    return write_params(tmp_path / "params.yaml", {"data": {**values, **data}})


def _shard_images(data) -> list[bytes]:
    manifest = json.loads((data / "manifest.json").read_text())
    images = []
    for shard in manifest["splits"]["train"]["shards"]:
        with tarfile.open(data / shard["name"]) as tar:
            images += [
                tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".jpg")
            ]
    return images


def test_rows_naming_images_outside_the_source_folder_are_skipped_unless_allowed(tmp_path):
    """`../x.jpg` and absolute paths are skipped as `outside_source` (a pairs file from someone
    else must not pull any image of this machine into shared data), unless
    data.allow_paths_outside_source says otherwise."""
    root = tmp_path / "src"
    root.mkdir()
    rows = []
    for i in range(4):
        (root / f"{i}.jpg").write_bytes(_jpeg(colour=(30 * i, 60, 90)))
        rows.append((f"{i}.jpg", f"第{i}张"))
    (tmp_path / "up.jpg").write_bytes(_jpeg(colour=(1, 2, 3)))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "abs.jpg").write_bytes(_jpeg(colour=(4, 5, 6)))
    rows += [("../up.jpg", "上一级"), (str(tmp_path / "elsewhere" / "abs.jpg"), "绝对路径")]
    rows.append(("sub/../2.jpg", "仍在目录内"))  # leaves and comes back: inside
    pairs = _pairs_file(root, rows)
    assert (
        main(["--params", str(_local_params(tmp_path, pairs)), "--out", str(tmp_path / "a")]) == 0
    )
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["skipped"]["counts"] == {"outside_source": 2}
    assert manifest["skipped"]["examples"]["outside_source"] == [f"{pairs}:5", f"{pairs}:6"]
    assert manifest["splits"]["train"]["count"] == 5
    allowed = _local_params(tmp_path, pairs, allow_paths_outside_source=True)
    assert main(["--params", str(allowed), "--out", str(tmp_path / "b")]) == 0
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["skipped"]["counts"] == {} and manifest["splits"]["train"]["count"] == 7


def test_folder_problems_each_have_their_own_reason(tmp_path):
    """A caption without its image was silently ignored; a directory named x.jpg and a symlink
    loop were counted as missing files."""
    root = tmp_path / "folder"
    root.mkdir()
    for i in range(3):
        (root / f"{i}.jpg").write_bytes(_jpeg(colour=(70 * i, 20, 20)))
        (root / f"{i}.txt").write_text(f"第{i}只鸟", encoding="utf-8")
    (root / "orphan.txt").write_text("没有图片的描述", encoding="utf-8")
    (root / "dir.jpg").mkdir()
    (root / "dir.txt").write_text("其实是目录", encoding="utf-8")
    (root / "loop.jpg").symlink_to("loop.jpg")
    (root / "loop.txt").write_text("循环链接", encoding="utf-8")
    (root / "gone.jpg").symlink_to("nowhere.jpg")
    (root / "gone.txt").write_text("悬空链接", encoding="utf-8")
    assert main(["--params", str(_local_params(tmp_path, root)), "--out", str(tmp_path / "d")]) == 0
    skipped = json.loads((tmp_path / "d" / "manifest.json").read_text())["skipped"]
    assert skipped["counts"] == {
        "is_a_directory": 1,
        "missing_file": 1,
        "missing_image": 1,
        "symlink_loop": 1,
    }
    assert skipped["examples"]["missing_image"] == [str(root / "orphan.txt")]
    assert skipped["examples"]["symlink_loop"] == [str(root / "loop.jpg")]


def test_a_16_bit_greyscale_png_keeps_its_grey_levels(tmp_path):
    """Not clipped to 8 bits (which would make every value above 255 of 65535, 99.6% of this
    ramp, white)."""
    import numpy as np

    root = tmp_path / "folder"
    root.mkdir()
    ramp = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)
    Image.fromarray(ramp).save(root / "deep.png")  # mode I;16
    (root / "deep.txt").write_text("灰度渐变", encoding="utf-8")
    assert Image.open(root / "deep.png").mode == "I;16"
    assert main(["--params", str(_local_params(tmp_path, root)), "--out", str(tmp_path / "d")]) == 0
    (jpeg,) = _shard_images(tmp_path / "d")
    grey = np.asarray(Image.open(io.BytesIO(jpeg)).convert("L"), dtype=np.float64)
    assert np.abs(grey - (ramp >> 8)).mean() < 2.0  # JPEG's own loss only
    assert (grey >= 254).mean() < 0.05


def _many_images(tmp_path, monkeypatch, count: int):
    """`count` pairs in src/pairs.jsonl, named relative to tmp_path (the working directory): the
    split hashes image paths, so they must not depend on where pytest puts tmp_path."""
    monkeypatch.chdir(tmp_path)
    root = Path("src")
    root.mkdir()
    rows = []
    for i in range(count):
        (root / f"{i:03d}.jpg").write_bytes(_jpeg(colour=(i * 3 % 256, i * 7 % 256, 99)))
        rows.append((f"{i:03d}.jpg", f"第{i}张图片"))
    return _pairs_file(root, rows)


def test_held_out_splits_too_small_to_measure_are_refused_naming_the_fraction(
    tmp_path, small_data, monkeypatch, capsys
):
    """64 good images with the default fractions gave 1 validation pair and 1 test image, exit 0
    without a word. Now: exit 2, one line per split naming the fraction to change; data/ kept."""
    pairs = _many_images(tmp_path, monkeypatch, 64)
    out = shutil.copytree(small_data, tmp_path / "data")
    before = sha256_file(out / "manifest.json")
    params = _local_params(tmp_path, pairs, val_fraction=0.02, test_fraction=0.02)
    assert main(["--params", str(params), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "clipforge.data: error: the val split has 1 pair (data.val_fraction=0.02 of 64 usable "
        "images): too few to measure anything; raise data.val_fraction to about 0.24, or set "
        "data.val_fraction: 0 to train without validation\n"
        "clipforge.data: error: the test split has 1 image (data.test_fraction=0.02 of 64 usable "
        "images): too few to measure anything; raise data.test_fraction to about 0.24, or set "
        "data.test_dir to a test set\n"
    )
    assert sha256_file(out / "manifest.json") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "params.yaml", "src"]


def test_a_test_split_too_small_for_recall_at_10_is_a_warning(tmp_path, monkeypatch, caplog):
    pairs = _many_images(tmp_path, monkeypatch, 64)
    params = _local_params(tmp_path, pairs, test_fraction=0.1)
    assert main(["--params", str(params), "--out", "data"]) == 0
    test = json.loads((tmp_path / "data" / "manifest.json").read_text())["splits"]["test"]
    assert 2 <= test["images"] < 10
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"the test split has {test['images']} images (data.test_fraction=0.1 of 64 usable "
        f"images): recall@10 over fewer than 10 is 100% whatever the model; raise "
        f"data.test_fraction to about 0.24, or set data.test_dir to a test set"
    ]


def _stage_blocked_on_a_fifo(tmp_path):
    """A data stage started in a subprocess and held, its partial output folder made, reading a
    CSV that is a FIFO this test writes: stopped there whatever the speed of the machine."""
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    fifo = source / "pairs.csv"
    os.mkfifo(fifo)
    params = write_params(
        tmp_path / "params.yaml", {"data": {"source": "local", "path": str(fifo)}}
    )
    stage = subprocess.Popen(
        [sys.executable, "-m", "clipforge.data", "--params", str(params), "--out", "data"],
        cwd=tmp_path,
        env=subprocess_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    writer = os.fdopen(_open_once_read(fifo, stage), "w")
    writer.write("image,caption\n")
    writer.flush()
    return stage, writer


def _open_once_read(fifo, stage) -> int:
    """The FIFO's write end, once the stage has opened it for reading (or a failure if the stage
    ends first: a plain open would then wait for ever)."""

    def open_write_end() -> int | None:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads
        except OSError:
            return None

    fd = wait_for(
        open_write_end,
        what="the stage opening its source",
        check=still_running(stage, stage.stderr.read),
        interval=0.02,
    )
    os.set_blocking(fd, True)
    return fd


def _partials(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob(".data.*"))


def test_a_stopped_or_killed_data_stage_leaves_no_partial_folder_for_long(tmp_path, small_data):
    """SIGTERM: the stage removes its half-written output itself and exits 143. SIGKILL leaves
    it behind; the next run removes it. data/ stays whole throughout."""
    shutil.copytree(small_data, tmp_path / "data")
    before = sha256_file(tmp_path / "data" / "manifest.json")
    stage, writer = _stage_blocked_on_a_fifo(tmp_path)
    with writer:
        assert len(_partials(tmp_path)) == 1
        stage.send_signal(signal.SIGTERM)
        assert stage.wait(timeout=60) == 128 + signal.SIGTERM
    assert _partials(tmp_path) == []

    (tmp_path / "src" / "pairs.csv").unlink()
    stage, writer = _stage_blocked_on_a_fifo(tmp_path)
    with writer:
        stage.kill()
        stage.wait(timeout=60)
    (left,) = _partials(tmp_path)
    assert left.startswith(f".data.partial-{stage.pid}-")
    assert sha256_file(tmp_path / "data" / "manifest.json") == before

    rerun = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipforge.data",
            "--params",
            str(write_params(tmp_path / "params.yaml")),
            "--out",
            "data",
        ],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert f"removing {left}, left by an interrupted run" in rerun.stderr
    assert _partials(tmp_path) == []


# -- no silent wrong number (issue: a 1-image test set scored 100, copies leaked into test) ----
def _given_test_set(directory: Path, num_images: int, described: int | None = None) -> Path:
    """A Chinese-CLIP test set of `num_images` distinct images, one caption each, describing the
    first `described` images only (all by default; the others get another's caption)."""
    directory.mkdir()
    with (
        open(directory / "test_imgs.tsv", "w") as imgs,
        open(directory / "test_texts.jsonl", "w") as texts,
    ):
        for i in range(num_images):
            payload = base64.b64encode(_jpeg(colour=(30 * i % 256, 10, 10))).decode()
            imgs.write(f"{i}\t{payload}\n")
            image = i % (described or num_images)
            texts.write(json.dumps({"text_id": i, "text": f"图{i}", "image_ids": [image]}) + "\n")
    return directory


def test_a_given_test_set_of_one_image_is_refused_before_anything_is_written(tmp_path, capsys):
    """data.test_dir with one image and one text: exit 2, one line for each direction, no data/
    written (it would report 100.0 for every recall)."""
    given = _given_test_set(tmp_path / "given", 1)
    params = write_params(tmp_path / "params.yaml", {"data": {"test_dir": str(given)}})
    assert main(["--params", str(params), "--out", str(tmp_path / "data")]) == 2
    assert capsys.readouterr().err == (
        "clipforge.data: error: data.test_dir: text->image has 1 query (captions): a recall over "
        "fewer than 2 is 0 or 100 whatever the model\n"
        "clipforge.data: error: data.test_dir: image->text has 1 query (images some caption "
        "describes): a recall over fewer than 2 is 0 or 100 whatever the model\n"
    )
    assert not (tmp_path / "data").exists()


def test_a_given_test_set_whose_captions_all_describe_one_image_is_refused(tmp_path, capsys):
    """Twelve images, twelve captions, all of one image: image->text is one query (R@1/5/10 =
    100 over it), refused by the eval stage's rule for a retrieval suite."""
    given = _given_test_set(tmp_path / "given", 12, described=1)
    params = write_params(tmp_path / "params.yaml", {"data": {"test_dir": str(given)}})
    assert main(["--params", str(params), "--out", str(tmp_path / "data")]) == 2
    assert capsys.readouterr().err == (
        "clipforge.data: error: data.test_dir: image->text has 1 query (images some caption "
        "describes): a recall over fewer than 2 is 0 or 100 whatever the model\n"
    )
    assert not (tmp_path / "data").exists()


def test_a_given_test_set_under_ten_images_is_a_warning(tmp_path, caplog):
    given = _given_test_set(tmp_path / "given", 5)
    params = write_params(tmp_path / "params.yaml", {"data": {"test_dir": str(given)}})
    assert main(["--params", str(params), "--out", str(tmp_path / "data")]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"data.test_dir: {direction} ranks 5 {unit}: recall@10 over fewer than 10 is 100 "
        f"whatever the model"
        for direction, unit in (("text->image", "images"), ("image->text", "captions"))
    ]


def test_identical_pairs_are_kept_once_before_splitting(tmp_path, monkeypatch, caplog):
    """50 more copies of one of 64 distinct pairs (same bytes, same caption, other paths): it is
    kept once, the 50 counted as duplicate_pair with one warning, so no copy lands in the test set of the
    images it trained on."""
    pairs = _many_images(tmp_path, monkeypatch, 64)
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    for i in range(50):
        shutil.copyfile(pairs.parent / "000.jpg", pairs.parent / f"copy{i}.jpg")
        rows.append({"image": f"copy{i}.jpg", "caption": rows[0]["caption"]})
    pairs.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    params = _local_params(tmp_path, pairs, test_fraction=0.3)
    assert main(["--params", str(params), "--out", "data"]) == 0
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["skipped"]["counts"] == {"duplicate_pair": 50}
    assert manifest["source"]["num_images"] == 64
    splits = manifest["splits"]
    assert splits["train"]["count"] + splits["test"]["images"] == 64
    warnings = [
        r.getMessage() for r in caplog.records if "copies of another pair" in r.getMessage()
    ]
    assert warnings == [
        "50 pairs are copies of another pair (same image, same caption): each is kept once, so "
        "that none is scored on an image it was trained on"
    ]
