"""LAION metadata filters, path expansion and img2dataset's failure messages (no download)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clipforge.data import download
from clipforge.data.config import DataConfig
from clipforge.data.inputs import expand_paths
from clipforge.data.laion import filter_into_work_dir
from clipforge.data.laion_filter import FilterReport, filtered_tables, looks_chinese
from clipforge.errors import StageError


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _rows(n, start=0, **extra):
    return [
        {
            "URL": f"https://example.org/{start + i}.jpg",
            "TEXT": f"第{start + i}只猫在沙发上",
            "similarity": 0.4,
            "WIDTH": 200,
            "HEIGHT": 150,
            **extra,
        }
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "caption, chinese",
    [
        ("一只橘猫趴在窗台上", True),
        ("iPhone 13 手机壳 透明", True),  # Latin brand names among Chinese
        ("猫の写真です", False),  # kana: Japanese
        ("고양이 사진", False),  # hangul: Korean
        ("a cat on the sofa", False),
        ("Apple iPhone case 壳", False),  # Han is under a third of the letters
    ],
)
def test_script_detection_tells_chinese_from_neighbours(caption, chinese):
    """Without a LANGUAGE column, Chinese = Han, no kana/hangul, Han >= 1/3 of the letters."""
    assert looks_chinese(pa.array([caption])).to_pylist() == [chinese]


def test_counts_add_up_to_the_rows_read(tmp_path):
    """rows_read = kept + every filter's removals, and kept rows are what the tables hold."""
    rows = _rows(5) + _rows(2, start=100, similarity=0.1) + _rows(1, start=200, TEXT="a cat")
    report = FilterReport([])
    tables = list(filtered_tables([_write(tmp_path / "a.parquet", rows)], DataConfig(), report))
    assert report.rows_read == len(rows) == report.kept + sum(report.removed.values())
    assert sum(t.num_rows for t in tables) == report.kept == 5


def _with_bytes_in(table: pa.Table, column: str, values: list[bytes], kind) -> pa.Table:
    """`table` with `column` replaced by these bytes, typed `kind`: pyarrow checks UTF-8 when it
    builds a string array from Python, not when it reads one from parquet, so a string column of
    bad bytes is built from its buffers."""
    array = pa.array(values, pa.binary())
    if kind == pa.string():
        array = pa.Array.from_buffers(pa.string(), len(array), array.buffers())
    return table.set_column(table.schema.get_field_index(column), column, array)


@pytest.mark.parametrize("kind", [pa.string(), pa.binary()], ids=["string", "binary"])
def test_rows_that_are_not_utf8_are_skipped_and_counted(tmp_path, kind):
    """A caption or URL that is not UTF-8 (a string column pyarrow never checked, or a binary
    one) is one row's problem in a 100M-row download: counted as caption_not_utf8 or bad_url,
    never a pyarrow.lib.ArrowInvalid or UnicodeDecodeError; the other rows reach img2dataset's
    input."""
    rows = _rows(4)
    table = pa.Table.from_pylist(rows)
    captions = [r["TEXT"].encode() for r in rows]
    table = _with_bytes_in(table, "TEXT", captions[:2] + [b"\xff\xfe cat"] + captions[3:], kind)
    urls = [r["URL"].encode() for r in rows]
    table = _with_bytes_in(table, "URL", urls[:3] + [b"https://example.org/\xc3(.jpg"], kind)
    pq.write_table(table, tmp_path / "a.parquet")
    report = FilterReport([])
    work = filter_into_work_dir([str(tmp_path / "a.parquet")], DataConfig(), report, tmp_path)
    assert (report.removed["caption_not_utf8"], report.removed["bad_url"], report.kept) == (1, 1, 2)
    kept = pq.read_table(work / "input.parquet").to_pylist()
    assert kept == [{"url": r["URL"], "caption": r["TEXT"]} for r in rows[:2]]


def test_files_are_streamed_not_loaded_together(tmp_path):
    """The first file's rows come out before the second file is even opened (here: is broken)."""
    good = _write(tmp_path / "a.parquet", _rows(3))
    (tmp_path / "b.parquet").write_bytes(b"not parquet")
    tables = filtered_tables([good, str(tmp_path / "b.parquet")], DataConfig(), FilterReport([]))
    assert next(tables).num_rows == 3
    with pytest.raises(StageError, match="b.parquet is not a readable parquet file"):
        next(tables)


def test_missing_url_column_is_named(tmp_path):
    """A file without LAION's URL column is refused, listing the columns it has."""
    path = _write(tmp_path / "a.parquet", [{"link": "https://x/1.jpg", "TEXT": "猫"}])
    with pytest.raises(StageError, match=r"has no URL column \(columns: link, TEXT\)"):
        list(filtered_tables([path], DataConfig(), FilterReport([])))


def test_missing_similarity_column_points_at_the_knob(tmp_path):
    """No `similarity` column with min_similarity > 0: say how to turn that filter off."""
    path = _write(tmp_path / "a.parquet", [{"URL": "https://x/1.jpg", "TEXT": "猫"}])
    with pytest.raises(StageError, match="set data.min_similarity: 0"):
        list(filtered_tables([path], DataConfig(), FilterReport([])))


def test_columns_match_case_insensitively(tmp_path):
    """Lower-case url/text (some LAION derivatives) are LAION's URL/TEXT."""
    path = _write(
        tmp_path / "a.parquet", [{"url": "https://x/1.jpg", "text": "一只猫", "SIMILARITY": 0.5}]
    )
    report = FilterReport([])
    assert sum(t.num_rows for t in filtered_tables([path], DataConfig(), report)) == 1


def test_globs_ranges_and_fsspec_urls_expand_in_sorted_order(tmp_path):
    """data.paths entries: glob, {a..b} range and file:// URL all become concrete files."""
    for i in range(3):
        _write(tmp_path / f"part-{i}.parquet", _rows(1))
    assert expand_paths([str(tmp_path / "part-*.parquet")], "x") == [
        str(tmp_path / f"part-{i}.parquet") for i in range(3)
    ]
    assert expand_paths([str(tmp_path / "part-{0..1}.parquet")], "x") == [
        str(tmp_path / f"part-{i}.parquet") for i in range(2)
    ]
    assert expand_paths([f"file://{tmp_path}/part-*.parquet"], "x") == [
        f"file://{tmp_path}/part-{i}.parquet" for i in range(3)
    ]


def test_a_file_listed_twice_is_refused(tmp_path):
    """The same file twice would download every row twice."""
    path = _write(tmp_path / "a.parquet", _rows(1))
    with pytest.raises(StageError, match="listed more than once"):
        expand_paths([path, str(tmp_path / "*.parquet")], "x")


@pytest.mark.parametrize(
    "status, message, reason",
    [
        ("failed_to_download", "HTTP Error 404: Not Found", "not_found"),
        ("failed_to_download", "HTTP Error 503: Service Unavailable", "http_error"),
        ("failed_to_download", "The read operation timed out", "timeout"),
        ("failed_to_download", "<urlopen error timed out>", "timeout"),
        ("failed_to_download", "<urlopen error [Errno 111] Connection refused>", "unreachable"),
        ("failed_to_download", "Use of image disallowed by X-Robots-Tag directive", "opted_out"),
        ("failed_to_resize", "Image decoding error", "corrupt_image"),
        ("failed_to_resize", "image area too large", "too_large"),
        ("failed_to_resize", "image too small", "too_small"),
        ("failed_to_resize", "aspect ratio too large", "bad_aspect_ratio"),
    ],
)
def test_img2dataset_failures_map_to_skip_reasons(status, message, reason):
    """img2dataset's per-row status and message become clipforge's skip reasons."""
    assert download.skip_reason(status, message) == reason


def test_missing_img2dataset_says_how_to_install_it(tmp_path, monkeypatch):
    """No tool anywhere: the error names `make img2dataset-env` and the override variable."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(download.ENV_VAR, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(StageError, match=r"make img2dataset-env.*CLIPFORGE_IMG2DATASET"):
        download.find_img2dataset()


def test_img2dataset_runs_without_our_pythonpath(monkeypatch):
    """The tool's environment drops PYTHONPATH (a newer webdataset there would shadow its pin)."""
    monkeypatch.setenv("PYTHONPATH", "/somewhere/site-packages")
    env = download.tool_env()
    assert "PYTHONPATH" not in env and env["WANDB_MODE"] == "disabled"
    assert os.environ["PYTHONPATH"] == "/somewhere/site-packages"
