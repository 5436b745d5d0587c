"""The webdataset source: shards made here (one good, one with bad samples, one cut short, one
that is not a tar), read through an fsspec URL with a `{..}` range, re-written into data/."""

from __future__ import annotations

import gzip
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from PIL import Image

from clipforge.data import testset
from clipforge.data.shards import ShardReader
from clipforge.data.stage import main
from clipforge.train.loader import split_files
from tests.conftest import subprocess_env
from tests.support.imageserver import jpeg_for
from tests.support.memory import run_measured
from tests.support.shards import write_tar


def _png(name: str) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(jpeg_for(name))).save(buffer, format="PNG")
    return buffer.getvalue()


def _sample(key: str, caption: str) -> list[tuple[str, bytes]]:
    return [(f"{key}.jpg", jpeg_for(key)), (f"{key}.txt", caption.encode("utf-8"))]


def make_shards(directory: Path) -> dict:
    directory.mkdir()
    good = [f"s0-{i:03d}" for i in range(12)]
    write_tar(directory / "shard-0000.tar", [m for k in good for m in _sample(k, f"好图片 {k}")])
    bad = [
        ("missing_caption", [("s1-000.jpg", jpeg_for("s1-000"))]),
        ("missing_image", [("s1-001.txt", "没有图片".encode())]),
        (
            "corrupt_image",
            [("s1-002.jpg", b"\xff\xd8 not a jpeg"), ("s1-002.txt", "坏图".encode())],
        ),
        ("caption_not_utf8", [("s1-003.jpg", jpeg_for("s1-003")), ("s1-003.txt", b"\xff\xfe\xfa")]),
        ("empty_caption", [("s1-004.jpg", jpeg_for("s1-004")), ("s1-004.txt", b" \n ")]),
    ]
    png_sample = [("s1-005.png", _png("s1-005")), ("s1-005.txt", "PNG 图片".encode())]
    write_tar(directory / "shard-0001.tar", [m for _, ms in bad for m in ms] + png_sample)
    cut = [f"s2-{i:03d}" for i in range(4)]
    full = directory / "full.tmp"
    write_tar(full, [m for k in cut for m in _sample(k, f"截断 {k}")])
    with tarfile.open(full) as tar:
        third_image = next(i for i in tar.getmembers() if i.name == "s2-002.jpg")
    raw = full.read_bytes()
    (directory / "shard-0002.tar").write_bytes(
        raw[: third_image.offset_data + third_image.size // 2]
    )
    full.unlink()
    (directory / "shard-0003.tar").write_bytes(b"this is not a tar file at all" * 40)
    return {
        "good": good,
        "bad": dict((reason, 1) for reason, _ in bad),
        "cut_kept": cut[:2],
        "png_key": "s1-005",
    }


@pytest.fixture(scope="module")
def wds_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("wds")
    expected = make_shards(root / "shards")
    testset.write_test_set(root / "flickr", [(0, jpeg_for("t0"), ["测试"])])
    params = {
        "data": {
            "source": "webdataset",
            "paths": [f"file://{root}/shards/shard-{{0000..0003}}.tar"],
            "val_fraction": 0.25,
            "test_fraction": 0.2,
            "samples_per_shard": 4,
        }
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert main(["--params", str(root / "params.yaml"), "--out", str(root / "data")]) == 0
    manifest = json.loads((root / "data" / "manifest.json").read_text(encoding="utf-8"))
    return {"root": root, "expected": expected, "manifest": manifest}


def _written_captions(data: Path) -> list[str]:
    captions = []
    for split in ("train", "val"):
        files = split_files(data, split)
        reader = ShardReader(files.paths)
        captions += [
            reader.read(s, i)["txt"].decode() for s, n in enumerate(files.counts) for i in range(n)
        ]
    captions += [t.text for t in testset.load_test_set(data / "test").texts]
    return captions


def test_bad_samples_and_damaged_shards_are_skipped_by_reason(wds_run):
    """Each malformed sample gets its reason; the cut and the non-tar shard count as corrupt."""
    counts = wds_run["manifest"]["skipped"]["counts"]
    assert counts == {**wds_run["expected"]["bad"], "corrupt_shard": 2}


def test_per_input_shard_counts_are_in_the_manifest(wds_run):
    """The manifest says, per input shard, how many samples were read and kept, and the error."""
    shards = {Path(s["shard"]).name: s for s in wds_run["manifest"]["source"]["shards"]}
    assert (shards["shard-0000.tar"]["samples"], shards["shard-0000.tar"]["kept"]) == (12, 12)
    assert (shards["shard-0001.tar"]["samples"], shards["shard-0001.tar"]["kept"]) == (6, 1)
    assert shards["shard-0002.tar"]["kept"] == 2 and shards["shard-0002.tar"]["error"]
    assert shards["shard-0003.tar"]["samples"] == 0 and shards["shard-0003.tar"]["error"]


def test_kept_samples_land_once_across_train_val_and_test(wds_run):
    """Every usable sample (complete ones before the damage included) is written exactly once."""
    expected = wds_run["expected"]
    wanted = [f"好图片 {k}" for k in expected["good"]] + [f"截断 {k}" for k in expected["cut_kept"]]
    wanted.append("PNG 图片")
    assert sorted(_written_captions(wds_run["root"] / "data")) == sorted(wanted)
    splits = wds_run["manifest"]["splits"]
    assert splits["train"]["count"] + splits["val"]["count"] + splits["test"]["images"] == len(
        wanted
    )


def test_jpegs_pass_through_unchanged(wds_run):
    """A JPEG sample's bytes are copied as they are: no second lossy encoding."""
    data = wds_run["root"] / "data"
    originals = {jpeg_for(k) for k in wds_run["expected"]["good"]}
    files = split_files(data, "train")
    reader = ShardReader(files.paths)
    images = [reader.read(s, i) for s, n in enumerate(files.counts) for i in range(n)]
    good = [s["jpg"] for s in images if s["txt"].decode().startswith("好图片")]
    assert good and all(jpeg in originals for jpeg in good)


def test_missing_shard_is_a_clear_error(tmp_path, capsys):
    """A path that matches nothing stops the stage with exit 2, naming the path."""
    params = {"data": {"source": "webdataset", "paths": [str(tmp_path / "nope-*.tar")]}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "data")]) == 2
    assert f"data.paths: {tmp_path}/nope-*.tar matches no file" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


# -- inputs that declare more than they hold: bounded memory -------------------------------------
GIB = 1 << 30
MEMORY_BOUND = GIB  # the data stage's own footprint is ~650 MB (python, torch, PIL)


def _header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.GNU_FORMAT)


def _padded(size: int) -> int:
    return (size + 511) // 512 * 512


def _member(name: str, payload: bytes) -> bytes:
    return _header(name, len(payload)) + payload.ljust(_padded(len(payload)), b"\0")


def make_bomb_shards(directory: Path) -> dict[str, Path]:
    """Shards of a few KB to 1 MB on disk that declare gigabytes, each after two good samples:
    `sparse`, a GNU sparse member declaring a 4 GiB image (10 KB, as GNU tar --sparse writes a
    file of holes); `hollow`, a plain tar whose 4 GiB image and 1 GiB caption are holes in a
    sparse file; `gzip`, a 1 GiB caption of zeros compressed to 1 MB; `pax`, a 1 GiB PAX header
    (a hole) before an image."""
    directory.mkdir()
    prefix = b"".join(
        _member(name, payload)
        for i in range(2)
        for name, payload in _sample(f"good-{i}", f"好 {i}")
    )
    end = bytes(1024)
    sparse = bytearray(_header("s.jpg", 0, tarfile.GNUTYPE_SPARSE))
    sparse[386:398] = b"%011o\0" % (4 * GIB)  # the map's one entry: data at 4 GiB, 0 bytes
    sparse[398:410] = b"%011o\0" % 0
    sparse[483:495] = b"%011o\0" % (4 * GIB)  # the member's size once its holes are filled
    sparse[148:156] = b" " * 8
    sparse[148:156] = b"%06o\0 " % sum(sparse)
    caption = _member("s.txt", "稀疏".encode())
    (directory / "sparse.tar").write_bytes(prefix + bytes(sparse) + caption + end)
    with open(directory / "hollow.tar", "wb") as f:
        f.write(prefix)
        for name, size in (("h.jpg", 4 * GIB), ("h.txt", GIB)):
            f.write(_header(name, size))
            f.seek(_padded(size), 1)  # a hole: nothing written, nothing on disk
        f.write(end)
    with open(directory / "pax.tar", "wb") as f:
        f.write(prefix + _header("p.jpg", GIB, tarfile.XHDTYPE))
        f.seek(GIB, 1)
        f.write(_member("p.jpg", jpeg_for("p")) + _member("p.txt", "扩展".encode()) + end)
    with gzip.open(directory / "gzip.tar.gz", "wb") as f:
        f.write(prefix + _member("g.jpg", jpeg_for("g")) + _header("g.txt", GIB))
        zeros = bytes(1 << 20)
        for _ in range(GIB // len(zeros)):
            f.write(zeros)
        f.write(end)
    names = {"sparse": "sparse.tar", "hollow": "hollow.tar", "pax": "pax.tar"}
    return {name: directory / file for name, file in {**names, "gzip": "gzip.tar.gz"}.items()}


def make_bomb_inputs(root: Path) -> dict[str, Path]:
    """make_bomb_shards' shards, and a test set to give as data.test_dir (`flickr`)."""
    root.mkdir()
    shards = make_bomb_shards(root / "shards")
    tests = [(i, jpeg_for(f"t{i}"), [f"测试{i}"]) for i in range(3)]
    testset.write_test_set(root / "flickr", tests)
    return {**shards, "flickr": root / "flickr"}


def data_stage_on_bombs(tmp_path: Path, shards: list[str], **data) -> tuple[dict, list]:
    """The data stage, as a process of its own, on these of make_bomb_shards' shards with these
    data params (nothing held out but the given test set): its skip counts and, per shard,
    (samples read, kept), once its peak memory is known to be under MEMORY_BOUND."""
    inputs = make_bomb_inputs(tmp_path / "inputs")
    params = {"source": "webdataset", "val_fraction": 0.0, "test_dir": str(inputs["flickr"])}
    params["paths"] = [str(inputs[name]) for name in shards]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"data": {**params, **data}}), "utf-8")
    argv = [sys.executable, "-m", "clipforge.data", "--params", str(tmp_path / "params.yaml")]
    result, peak = run_measured([*argv, "--out", str(tmp_path / "data")], env=subprocess_env())
    assert result.returncode == 0, result.stderr
    assert peak < MEMORY_BOUND, f"peak resident set {peak / 2**20:.0f} MiB"
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text(encoding="utf-8"))
    read_kept = [(s["samples"], s["kept"]) for s in manifest["source"]["shards"]]
    return manifest["skipped"]["counts"], read_kept


def test_members_declaring_gigabytes_are_skipped_unread_in_bounded_memory(tmp_path):
    """The four shards (4 GiB and 1 GiB members in 10 KB to 1 MB; the copy read them whole: 4.6,
    8.8 and 2.6 GB) are copied in under 1 GB: each oversized member is skipped by its size,
    counted as too_large or caption_too_long, and the good samples before them are kept; the
    PAX header ends its shard as corrupt_shard, as any damage does."""
    shards = ["sparse", "hollow", "gzip", "pax"]
    counts, read_kept = data_stage_on_bombs(tmp_path, shards, in_place=False)
    assert counts == {"too_large": 2, "caption_too_long": 1, "corrupt_shard": 1}
    assert read_kept == [(3, 2)] * 3 + [(1, 1)]  # the sample the header may belong to: cut
