"""The `laion-parquet` source: LAION-style metadata -> filters -> img2dataset -> the data/ layout.

  <data.download_dir>/laion-<key>/   key: hash of the kept rows and of the knobs that change images
    input.parquet                    the kept rows (url, caption): img2dataset's input
    img2dataset/                     its shards, per-row results and per-shard stats
    img2dataset.log
The download lives outside data/ (which is replaced whole on success) so it survives an
interruption: a rerun filters again (streaming; cheap next to downloading), finds the same key,
and img2dataset continues with the shards it has not finished. Changing a filter or the resize
policy gives another key, hence a fresh download. Successful samples are then re-written into
data/train and data/val (and a test set) in key order, so the same downloads always give the
same shards, whatever order the threads finished in. With data.in_place (`auto`: from
AUTO_IN_PLACE_ROWS rows), img2dataset's shards are indexed where they are instead
(clipforge.data.inplace): no second copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from clipforge.data import download, inplace
from clipforge.data.config import DataConfig
from clipforge.data.inputs import expand_paths
from clipforge.data.laion_filter import FilterReport, filtered_tables
from clipforge.data.samples import SizeLimits, SkipLog
from clipforge.data.shards import CaptionTokenizer, index_shard
from clipforge.data.splits import SplitWriter
from clipforge.errors import StageError
from clipforge.fsutil import atomic_file

log = logging.getLogger("clipforge.data")

# Knobs that change which images end up in the shards, or their pixels. Timeout, retries and
# parallelism are left out: raising the retries continues the same download.
_DOWNLOAD_KEYS = (
    "download_image_size",
    "resize_mode",
    "resize_only_if_bigger",
    "min_image_side",
    "max_aspect_ratio",
    "max_image_pixels",
    "download_samples_per_shard",
)


def build_splits(
    data: DataConfig, out: Path, skips: SkipLog, tokenize: CaptionTokenizer | None = None
) -> tuple[dict, dict]:
    files = expand_paths(data.paths, "LAION metadata .parquet files")
    report = FilterReport(files)
    work = filter_into_work_dir(files, data, report, Path(data.download_dir))
    shards_dir = work / "img2dataset"
    expected = math.ceil(report.kept / data.download_samples_per_shard)
    shard_names = [f"{i:05d}" for i in range(expected)]  # img2dataset's names (5 digits)
    done = set(download.finished_shards(shards_dir)) if shards_dir.is_dir() else set()
    with contextlib.ExitStack() as stack:
        job = None
        tool = "not run (all shards were already downloaded)"
        if len(done & set(shard_names)) < expected:
            executable = download.find_img2dataset()
            tool = download.tool_version(executable)
            log.info(
                "downloading %d rows in %d shards with %s into %s (%d shards already done)",
                report.kept,
                expected,
                tool,
                shards_dir,
                len(done),
            )
            job = stack.enter_context(
                download.running(
                    download.command(executable, work / "input.parquet", shards_dir, data),
                    shards_dir,
                    work / "img2dataset.log",
                )
            )
        in_place = in_place_download(data, report.kept)
        writer = None if in_place else SplitWriter(out, data, tokenize)
        for name in shard_names:
            if job is not None and name not in done:
                job.wait_for_shard(name)
            if in_place:  # failures counted now; the successes are indexed once all are there
                count_failures(shards_dir, name, skips)
            else:
                assert writer is not None  # made when not in place
                # Shards are re-written in order as soon as each is finished, while img2dataset
                # fetches the next ones: the copy costs no wall time but the last shard's.
                write_shard_samples(shards_dir, name, writer, skips)
    stats = download.shard_stats(shards_dir, expected)
    if in_place:
        tars = [str(shards_dir / f"{name}.tar") for name in shard_names]
        splits, _, decontamination = inplace.build_splits(
            data, out, skips, tars, "laion-parquet", tokenize
        )
    else:
        assert writer is not None  # made when not in place
        splits = writer.close()
        decontamination = writer.decontamination
    successes = sum(s.successes for s in stats)
    log.info(
        "downloaded %d of %d images (%.1f%%) in %d shards",
        successes,
        report.kept,
        100.0 * successes / report.kept,
        len(stats),
    )
    source: dict[str, Any] = {
        "type": "laion-parquet",
        "paths": list(data.paths),
        "files": files,
        "filters": report.to_dict(),
        "download": {
            "dir": str(work),
            "tool": tool,
            "rows": report.kept,
            "successes": successes,
            # durations stay in the stats files: the manifest must not change
            # when nothing but timing did (the train stage's run id hashes it)
            "shards": [
                {k: v for k, v in s.to_dict().items() if k != "duration_seconds"} for s in stats
            ],
        },
    }
    if in_place:
        source["in_place"] = True
    source["decontamination"] = decontamination
    return splits, source


# data.in_place: auto: a download of at least this many rows (about 10 GiB at 256 px) is indexed
# where img2dataset wrote it instead of copied into data/.
AUTO_IN_PLACE_ROWS = 1_000_000


def in_place_download(data: DataConfig, rows: int) -> bool:
    return rows >= AUTO_IN_PLACE_ROWS if data.in_place == "auto" else bool(data.in_place)


def count_failures(shards_dir: Path, shard: str, skips: SkipLog) -> None:
    """img2dataset's failed rows of one shard as skips (its successes are in the tar)."""
    for row in download.sample_statuses(shards_dir, shard):
        if row.status != "success":
            skips.add(download.skip_reason(row.status, row.error_message), row.url)


def filter_into_work_dir(
    files: list[str], data: DataConfig, report: FilterReport, root: Path
) -> Path:
    """Filter the metadata into <root>/laion-<key>/input.parquet, img2dataset's input; returns
    that work directory (the key is a hash of the kept rows and of the download knobs)."""
    with atomic_file(root, prefix=".kept-rows-", suffix=".parquet") as kept_rows:
        rows_digest = write_kept_rows(filtered_tables(files, data, report), kept_rows.path)
        log.info(
            "filters kept %d of %d rows (%s)",
            report.kept,
            report.rows_read,
            ", ".join(f"{k} -{v}" for k, v in report.removed.items() if v) or "none removed",
        )
        if report.kept == 0:
            raise StageError(
                f"no metadata row passed the filters: {json.dumps(report.removed)}; "
                f"check data.min_similarity, data.language and the other filters"
            )
        work = root / f"laion-{download_key(rows_digest, data)}"
        work.mkdir(exist_ok=True)
        if not (work / "input.parquet").exists():  # else same rows: keep what img2dataset sharded
            kept_rows.commit(work / "input.parquet")
    return work


def write_kept_rows(tables: Iterable, path: Path) -> str:
    """Stream the kept rows into a parquet file; returns a digest of the rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("url", pa.string()), ("caption", pa.string())])
    digest = hashlib.sha256()
    with pq.ParquetWriter(str(path), schema) as writer:
        for table in tables:
            if table.num_rows:
                writer.write_table(table)
                for url, caption in zip(
                    table.column("url").to_pylist(), table.column("caption").to_pylist()
                ):
                    digest.update(f"{url}\t{caption}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def download_key(rows_digest: str, data: DataConfig) -> str:
    knobs = {key: getattr(data, key) for key in _DOWNLOAD_KEYS}
    text = json.dumps({"rows": rows_digest, **knobs}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_shard_samples(shards_dir: Path, shard: str, writer: SplitWriter, skips: SkipLog) -> None:
    """Successes of one img2dataset shard into the splits (in key order); failures into skips."""
    tar = shards_dir / f"{shard}.tar"
    members = index_shard(tar)
    limits = SizeLimits.of(writer.data)
    with open(tar, "rb") as f:
        for row in download.sample_statuses(shards_dir, shard):
            if row.status != "success":
                skips.add(download.skip_reason(row.status, row.error_message), row.url)
                continue
            sample = members.get(row.key, {})
            if "jpg" not in sample or "txt" not in sample:
                raise StageError(
                    f"{tar}: img2dataset reports {row.key} ({row.url}) as downloaded "
                    f"but the shard does not hold it; delete {shards_dir} and rerun"
                )
            too_large = limits.skip_reason(False, sample["jpg"].size) or limits.skip_reason(
                True, sample["txt"].size
            )
            if too_large:  # img2dataset's own limits are other knobs: never read past these
                skips.add(too_large, row.url)
                continue
            jpeg, caption = (sample[ext].read(f) for ext in ("jpg", "txt"))
            writer.add(row.url, jpeg, caption.decode("utf-8"))
