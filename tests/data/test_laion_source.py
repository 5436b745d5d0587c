"""The laion-parquet source end to end: LAION metadata built here, images from a real HTTP server
on 127.0.0.1, the real img2dataset tool (.venv-img2dataset), the real data stage.

One scenario, run once for the module: two metadata files (one with a LANGUAGE column, one
without, so script detection decides) holding rows that each filter must remove, and URLs that
are broken, missing, slow, huge or flaky. The first run is stopped with SIGTERM while shard
00001 is in flight; the second run resumes. Each test checks one consequence.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from clipforge.data import testset
from clipforge.data.shards import ShardReader
from clipforge.train.loader import split_files
from tests.conftest import REPO, subprocess_env
from tests.support.imageserver import ImageServer, jpeg_for
from tests.support.wait import still_running, wait_for

ROWS_PER_SHARD = 10
MAX_CAPTION_CHARS = 40


def img2dataset_command() -> str:
    path = os.environ.get("CLIPFORGE_IMG2DATASET", str(REPO / ".venv-img2dataset/bin/img2dataset"))
    if not os.access(path, os.X_OK):
        pytest.fail(f"img2dataset not found at {path}: run `make img2dataset-env`")
    return path


def _row(url, text, similarity=0.4, width=96, height=80, **extra):
    return {
        "URL": url,
        "TEXT": text,
        "similarity": similarity,
        "WIDTH": width,
        "HEIGHT": height,
        **extra,
    }


def build_scenario(server: ImageServer, root: Path) -> dict:
    """Write the two metadata files; return what each row is expected to become."""
    good = [server.url("img", f"good{i}") for i in range(22)]
    captions = {url: f"第{i}张图片里有一只猫" for i, url in enumerate(good)}
    failing = {  # url -> the skip reason its download must get
        server.url("broken", "b1"): "corrupt_image",
        server.url("missing", "m1"): "not_found",
        server.url("slow", "s1"): "timeout",
        server.url("huge", "h1", "png"): "too_large",
        server.url("broken", "b2"): "corrupt_image",
        server.url("missing", "m2"): "not_found",
    }
    flaky, gate = server.url("flaky", "f1"), server.url("gate", "g1")
    captions.update({url: f"下载会失败的图片{i}" for i, url in enumerate(failing)})
    captions.update({flaky: "第一次请求失败的图片", gate: "下载到一半被打断的图片"})
    # kept rows in download order; img2dataset cuts them into shards of ROWS_PER_SHARD
    shard0 = good[:4] + list(failing)[:4] + [flaky] + good[4:5]  # finished before the stop
    shard1 = good[5:14] + [gate]  # in flight at the stop
    shard2 = good[14:22] + list(failing)[4:]  # not started
    kept = shard0 + shard1 + shard2
    in_a, in_b = kept[:15], kept[15:]
    removed_a = [  # (expected filter, row) with a LANGUAGE column
        ("bad_url", _row("ftp://example.org/a.jpg", "文件传输协议的图片", LANGUAGE="zh")),
        ("empty_caption", _row(server.url("img", "x1"), " \t ", LANGUAGE="zh")),
        (
            "caption_too_long",
            _row(server.url("img", "x2"), "长" * (MAX_CAPTION_CHARS + 1), LANGUAGE="zh"),
        ),
        ("low_similarity", _row(server.url("img", "x3"), "相似度太低的图片", 0.31, LANGUAGE="zh")),
        # fails two filters: counted once, against the first (similarity)
        ("low_similarity", _row(server.url("img", "x4"), "a photo of a dog", 0.1, LANGUAGE="en")),
        ("not_language", _row(server.url("img", "x5"), "a photo of a cat", LANGUAGE="en")),
        ("unsafe", _row(server.url("img", "x6"), "不适合的图片", LANGUAGE="zh", punsafe=0.9)),
        (
            "watermarked",
            _row(server.url("img", "x7"), "有水印的图片", LANGUAGE="zh", pwatermark=0.95),
        ),
        (
            "too_small",
            _row(server.url("img", "x8"), "很小的图片", width=40, height=300, LANGUAGE="zh"),
        ),
        (
            "bad_aspect_ratio",
            _row(server.url("img", "x9"), "很长的图片", width=400, height=100, LANGUAGE="zh"),
        ),
        ("duplicate_url", _row(kept[0], "同一个网址的另一个说明", LANGUAGE="zh")),
        ("duplicate_caption", _row(server.url("img", "x10"), captions[kept[1]], LANGUAGE="zh")),
    ]
    removed_b = [  # no LANGUAGE, punsafe or pwatermark column: script detection decides
        ("not_language", _row(server.url("img", "y1"), "こんにちは、猫の写真です")),
        ("not_language", _row(server.url("img", "y2"), "a cat sitting on a sofa")),
        ("duplicate_url", _row(kept[2], "跨文件重复的网址")),
    ]
    rows_a = [_row(u, captions[u], LANGUAGE="zh", punsafe=0.01, pwatermark=0.1) for u in in_a]
    rows_a += [r for _, r in removed_a]
    for row in rows_a:
        row.setdefault("punsafe", 0.01)
        row.setdefault("pwatermark", 0.1)
    rows_b = [_row(u, captions[u]) for u in in_b] + [r for _, r in removed_b]
    # a TEXT column of bytes, one row not UTF-8 (pyarrow.lib.ArrowInvalid once): skipped, counted
    not_utf8 = _row(server.url("img", "y3"), "不是")
    rows_b.append(not_utf8)
    removed_b.append(("caption_not_utf8", not_utf8))
    table_b = pa.Table.from_pylist(rows_b)
    texts = [r["TEXT"].encode() for r in rows_b[:-1]] + ["不是".encode() + b"\xff\xfe UTF-8"]
    table_b = table_b.set_column(
        table_b.schema.get_field_index("TEXT"), "TEXT", pa.array(texts, pa.binary())
    )
    (root / "meta").mkdir()
    pq.write_table(pa.Table.from_pylist(rows_a), root / "meta" / "part-00000.parquet")
    pq.write_table(table_b, root / "meta" / "part-00001.parquet")
    expected_removed = {}
    for name, _ in removed_a + removed_b:
        expected_removed[name] = expected_removed.get(name, 0) + 1
    return {
        "kept": kept,
        "captions": captions,
        "failing": failing,
        "shards": [shard0, shard1, shard2],
        "removed": expected_removed,
        "rows_read": len(rows_a) + len(rows_b),
        "rows_without_nsfw_columns": len(rows_b),
        "gate": gate,
        "flaky": flaky,
    }


def write_test_dir(path: Path) -> None:
    testset.write_test_set(path, [(i, jpeg_for(f"test{i}"), [f"测试图片{i}"]) for i in range(3)])


@pytest.fixture(scope="module")
def laion_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("laion")
    env = subprocess_env() | {"CLIPFORGE_IMG2DATASET": img2dataset_command()}
    with ImageServer(slow_seconds=8.0, huge_size=(1500, 1000)) as server:
        scenario = build_scenario(server, root)
        write_test_dir(root / "flickr-cn")
        params = {
            "data": {
                "source": "laion-parquet",
                "paths": [f"file://{root}/meta/*.parquet"],
                "test_dir": str(root / "flickr-cn"),
                "val_fraction": 0.4,
                "max_caption_chars": MAX_CAPTION_CHARS,
                "max_image_pixels": 1_000_000,
                "download_timeout_seconds": 3,
                "download_retries": 1,
                "download_processes": 1,
                "download_threads": 8,
                "download_samples_per_shard": ROWS_PER_SHARD,
            }
        }
        (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
        first = subprocess.Popen(
            [sys.executable, "-m", "clipforge.data"],
            cwd=root,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        downloads = root / "downloads"
        wait_for(
            lambda: (
                list(downloads.glob("laion-*/img2dataset/00000_stats.json"))
                and server.count(scenario["gate"]) >= 1
            ),
            what="the first run reaching shard 00001",
            check=still_running(first, first.stderr.read),
        )
        finished_before = sorted(p.name for p in downloads.glob("laion-*/img2dataset/*_stats.json"))
        stats_before = (next(downloads.glob("laion-*/img2dataset/00000_stats.json"))).read_bytes()
        first.send_signal(signal.SIGTERM)
        first_code = first.wait(timeout=60)
        first_stderr = first.stderr.read()
        left_after_stop = sorted(p.name for p in root.glob("*data*"))
        server.release()
        second = subprocess.run(
            [sys.executable, "-m", "clipforge.data"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 0, second.stderr
        requests = {url: server.count(url) for url in scenario["kept"]}
    manifest = json.loads((root / "data" / "manifest.json").read_text(encoding="utf-8"))
    return {
        "root": root,
        "scenario": scenario,
        "manifest": manifest,
        "first_code": first_code,
        "first_stderr": first_stderr,
        "left_after_stop": left_after_stop,
        "finished_before": finished_before,
        "stats_before": stats_before,
        "requests": requests,
        "second_stderr": second.stderr,
    }


def test_filters_remove_exactly_the_constructed_rows(laion_run):
    """Each filter's count is the number of rows built to fail it (first failing filter only)."""
    filters = laion_run["manifest"]["source"]["filters"]
    expected = {name: laion_run["scenario"]["removed"].get(name, 0) for name in filters["removed"]}
    assert filters["removed"] == expected
    assert filters["kept"] == len(laion_run["scenario"]["kept"])
    assert filters["rows_read"] == laion_run["scenario"]["rows_read"]


def test_filters_without_their_column_are_reported_not_applied(laion_run):
    """The file lacking punsafe/pwatermark is not filtered on them, and the manifest says so;
    its language is decided by script detection."""
    filters = laion_run["manifest"]["source"]["filters"]
    rows_b = laion_run["scenario"]["rows_without_nsfw_columns"]
    assert filters["not_applied"]["unsafe"]["rows"] == rows_b
    assert filters["not_applied"]["watermarked"]["rows"] == rows_b
    assert filters["language_detection"]["script"] == rows_b


def test_download_failures_are_counted_by_reason(laion_run):
    """Broken, missing, slow and huge images are skipped with their own reason, each once."""
    expected: dict[str, int] = {}
    for reason in laion_run["scenario"]["failing"].values():
        expected[reason] = expected.get(reason, 0) + 1
    assert laion_run["manifest"]["skipped"]["counts"] == expected, laion_run["manifest"]["skipped"]


def test_every_downloaded_image_lands_once_in_train_or_val(laion_run):
    """After the interruption and resume, the shards hold each successful download exactly once
    (the flaky URL succeeded on its retry), readable by the training reader."""
    data = laion_run["root"] / "data"
    captions = []
    for split in ("train", "val"):
        files = split_files(data, split)
        reader = ShardReader(files.paths)
        for shard, count in enumerate(files.counts):
            for index in range(count):
                sample = reader.read(shard, index)
                assert sample["jpg"][:2] == b"\xff\xd8"
                captions.append(sample["txt"].decode("utf-8"))
    scenario = laion_run["scenario"]
    expected = [scenario["captions"][u] for u in scenario["kept"] if u not in scenario["failing"]]
    assert sorted(captions) == sorted(expected)


def test_per_shard_download_stats_add_up(laion_run):
    """The manifest lists img2dataset's per-shard counts; they sum to the kept rows."""
    download = laion_run["manifest"]["source"]["download"]
    assert [s["count"] for s in download["shards"]] == [
        len(s) for s in laion_run["scenario"]["shards"]
    ]
    assert sum(s["successes"] for s in download["shards"]) == download["successes"]
    assert download["successes"] == len(laion_run["scenario"]["kept"]) - len(
        laion_run["scenario"]["failing"]
    )


def test_manifest_names_the_versions_the_tool_environment_holds(laion_run):
    """The tool versions in the manifest are the ones img2dataset's own Python reports (read from
    that environment's package metadata, not from clipforge's, whose webdataset differs)."""
    python = Path(img2dataset_command()).with_name("python")
    reported = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m; "
            "print(m.version('img2dataset'), m.version('webdataset'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    tool = laion_run["manifest"]["source"]["download"]["tool"]
    assert tool == f"img2dataset {reported[0]} (webdataset {reported[1]})"


def test_sigterm_stops_the_stage_and_its_img2dataset_processes(laion_run):
    """SIGTERM mid-download: exit 143, no data/ yet from that run, img2dataset's group gone."""
    assert laion_run["first_code"] == 128 + signal.SIGTERM
    assert laion_run["left_after_stop"] == []  # neither data/ nor a half-written .data.partial-*
    match = re.search(r"stopping img2dataset \(process group (\d+)\)", laion_run["first_stderr"])
    assert match, laion_run["first_stderr"]
    with pytest.raises(ProcessLookupError):
        os.killpg(int(match.group(1)), 0)


def test_resume_keeps_finished_shards_and_does_not_fetch_them_again(laion_run):
    """Shard 00000 finished before the stop: the rerun neither rewrites nor re-downloads it."""
    assert laion_run["finished_before"] == ["00000_stats.json"]
    stats = next((laion_run["root"] / "downloads").glob("laion-*/img2dataset/00000_stats.json"))
    assert stats.read_bytes() == laion_run["stats_before"]
    scenario = laion_run["scenario"]
    plain = [u for u in scenario["shards"][0] if "/img/" in u]
    assert plain and all(laion_run["requests"][u] == 1 for u in plain)
    assert "(1 shards already done)" in laion_run["second_stderr"]


def test_test_set_comes_from_test_dir(laion_run):
    """With data.test_dir (e.g. Flickr30K-CN) the test set is copied, not split off the download."""
    test = laion_run["manifest"]["splits"]["test"]
    assert (test["images"], test["texts"]) == (3, 3)


def test_the_download_can_be_indexed_in_place(laion_run):
    """data.in_place: true indexes img2dataset's shards where they are: the same images, read
    from the download directory (nothing copied into data/), the same failures by reason."""
    root = laion_run["root"]
    done = subprocess.run(
        [sys.executable, "-m", "clipforge.data", "--out", "data-in-place"]
        + ["--set", "data.in_place=true", "--set", "data.verify=all"],
        cwd=root,
        env=subprocess_env(),  # every shard is downloaded: img2dataset is not run again
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    data = root / "data-in-place"
    assert not list(data.rglob("*.tar"))
    manifest = json.loads((data / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["skipped"]["counts"] == laion_run["manifest"]["skipped"]["counts"]
    assert manifest["decontamination"]["checked"]
    captions = []
    for split in ("train", "val"):
        files = split_files(data, split)
        reader = files.reader()
        for shard, count in enumerate(files.counts):
            captions += [reader.read(shard, i)["txt"].decode() for i in range(count)]
    scenario = laion_run["scenario"]
    expected = [scenario["captions"][u] for u in scenario["kept"] if u not in scenario["failing"]]
    assert sorted(captions) == sorted(expected)
