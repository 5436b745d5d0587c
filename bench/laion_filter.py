"""The LAION filter (clipforge.data.laion_filter) against duckdb doing the same filters on the
same parquet files, and the de-duplication's memory.

    .venv/bin/python bench/laion_filter.py [--rows 2000000] [--files 4]

The metadata is generated here with LAION's columns (URL, TEXT, WIDTH, HEIGHT, similarity,
LANGUAGE, punsafe, pwatermark), Chinese captions of realistic length, 10% repeated URLs and 5%
repeated captions. duckdb runs the same filters in the same order: URL regex, caption clean-up
and length, similarity, LANGUAGE, punsafe, pwatermark, shorter side, aspect ratio, then the first
row of each URL and of each caption in file order (QUALIFY row_number() over file_row_number).
Both must keep the same number of rows (checked). duckdb is timed with 1 thread and with all
cores; clipforge's filter runs in one process. Needs `pip install duckdb` (not a dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHARS = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明"


def make_metadata(directory: Path, rows: int, files: int, seed: int = 0) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    paths = []
    per_file = rows // files
    alphabet = np.array(list(CHARS))
    for number in range(files):
        n = per_file
        ids = rng.integers(0, int(rows * 0.9), n)  # ~10% of URLs repeat
        urls = [f"https://img{i % 97}.example.cn/photos/{i:012d}.jpg" for i in ids]
        lengths = rng.integers(4, 40, n)
        caption_ids = rng.integers(0, int(rows * 0.95), n)
        captions = []
        for length, cid in zip(lengths, caption_ids):
            local = np.random.default_rng(int(cid))
            captions.append("".join(alphabet[local.integers(0, len(alphabet), length)]))
        table = pa.table(
            {
                "URL": urls,
                "TEXT": captions,
                "WIDTH": rng.integers(32, 1024, n),
                "HEIGHT": rng.integers(32, 1024, n),
                "similarity": rng.uniform(0.2, 0.45, n),
                "LANGUAGE": rng.choice(["zh", "ja", "ko"], n, p=[0.9, 0.05, 0.05]),
                "punsafe": rng.uniform(0, 0.7, n),
                "pwatermark": rng.uniform(0, 1, n),
            }
        )
        path = directory / f"part-{number:05d}.parquet"
        pq.write_table(table, path)
        paths.append(str(path))
    return paths


def clipforge_filter(files: list[str]) -> tuple[float, int, int]:
    from clipforge.data import laion_filter
    from clipforge.data.config import DataConfig

    report = laion_filter.FilterReport(files)
    began = time.perf_counter()
    kept = sum(t.num_rows for t in laion_filter.filtered_tables(files, DataConfig(), report))
    seconds = time.perf_counter() - began
    dedup = laion_filter.Deduplicator(True, True, laion_filter._rows_in(files))
    return seconds, kept, dedup.nbytes


DUCKDB_SQL = r"""
WITH src AS (
  SELECT filename, file_row_number AS rid, URL, WIDTH, HEIGHT, similarity, LANGUAGE, punsafe,
         pwatermark, trim(regexp_replace(TEXT, '[\s\p{Z}]+', ' ', 'g')) AS caption
  FROM read_parquet(?, filename = true, file_row_number = true)
), f AS (
  SELECT * FROM src
  WHERE regexp_full_match(URL, '(?i)https?://\S+')
    AND length(caption) > 0 AND length(caption) <= 512
    AND similarity >= 0.32 AND lower(LANGUAGE) = 'zh'
    AND punsafe <= 0.5 AND pwatermark <= 0.8
    AND least(WIDTH, HEIGHT) >= 64
    AND greatest(WIDTH, HEIGHT)::DOUBLE / least(WIDTH, HEIGHT) <= 3.0
), u AS (
  SELECT * FROM f QUALIFY row_number() OVER (PARTITION BY URL ORDER BY filename, rid) = 1
), k AS (
  SELECT * FROM u QUALIFY row_number() OVER (PARTITION BY caption ORDER BY filename, rid) = 1
)
SELECT count(*) FROM k
"""


def duckdb_filter(files: list[str], threads: int) -> tuple[float, int]:
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET threads = {threads}")
    began = time.perf_counter()
    (kept,) = con.execute(DUCKDB_SQL, [files]).fetchone()
    return time.perf_counter() - began, int(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--files", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = make_metadata(Path(tmp), args.rows, args.files)
        rows = args.rows // args.files * args.files
        ours, kept, dedup_bytes = clipforge_filter(files)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        results = {
            "rows": rows,
            "kept": kept,
            "clipforge_rows_per_s": round(rows / ours),
            "dedup_table_bytes": dedup_bytes,
            "dedup_bytes_per_row": round(dedup_bytes / rows, 2),
            "dedup_gb_at_100M_rows": round(dedup_bytes / rows * 1e8 / 1e9, 2),
            "process_peak_rss_mb": round(rss_mb),
        }
        try:
            for threads in sorted({1, os.cpu_count() or 1}):
                seconds, duck_kept = duckdb_filter(files, threads)
                results[f"duckdb_{threads}_threads_rows_per_s"] = round(rows / seconds)
                results[f"ratio_clipforge_to_duckdb_{threads}_threads"] = round(seconds / ours, 3)
                results["duckdb_kept"] = duck_kept
        except ImportError:
            results["duckdb"] = "not installed (pip install duckdb)"
    json.dump(results, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
