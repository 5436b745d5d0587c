"""laion-parquet, step 1: LAION-style metadata -> the rows worth downloading, and why not the rest.

Columns are LAION's own (matched case-insensitively): URL, TEXT, WIDTH, HEIGHT, similarity,
LANGUAGE (multilingual subsets only), punsafe, pwatermark. Files are read one record batch at a
time (pyarrow ParquetFile.iter_batches, through fsspec for remote URLs), so memory stays flat
whatever the number of files; de-duplication keeps 64-bit hashes in numpy hash tables sized from
the footers' row counts (clipforge.data.dedup: ~19 bytes per row read for both sets, 1.9 GB at
100M rows), never a Python object per row.

Filters run in FILTERS order and a row is counted once, against the first filter that removes
it, so the counts add up: rows_read = kept + sum(removed). A row with a null where a filter
needs a value is removed by that filter. A filter whose column a file lacks is not applied to
that file's rows, and the report says so (`not_applied`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clipforge.data.config import DataConfig
from clipforge.data.dedup import HashSet64, first_occurrences, hash_strings
from clipforge.data.inputs import open_input
from clipforge.errors import StageError

FILTERS = (
    "bad_url",
    "caption_not_utf8",
    "empty_caption",
    "caption_too_long",
    "low_similarity",
    "not_language",
    "unsafe",
    "watermarked",
    "too_small",
    "bad_aspect_ratio",
    "duplicate_url",
    "duplicate_caption",
)
# role -> LAION's column name
COLUMNS = {
    "url": "URL",
    "text": "TEXT",
    "width": "WIDTH",
    "height": "HEIGHT",
    "similarity": "similarity",
    "language": "LANGUAGE",
    "punsafe": "punsafe",
    "pwatermark": "pwatermark",
}
BATCH_ROWS = 65536
# Script detection (no LANGUAGE column): Chinese = some Han, no kana or hangul (which would make
# it Japanese or Korean), and Han at least a third of the letters (brand names in Latin are fine).
_HAN, _KANA_HANGUL, _LETTER = r"\p{Han}", r"[\p{Hiragana}\p{Katakana}\p{Hangul}]", r"\pL"


@dataclass
class FilterReport:
    files: list[str]
    rows_read: int = 0
    kept: int = 0
    removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FILTERS, 0))
    not_applied: dict[str, dict] = field(default_factory=dict)  # filter -> {rows, reason}
    language_detection: dict[str, int] = field(default_factory=dict)  # method -> rows

    def skip(self, name: str, rows: int, reason: str) -> None:
        entry = self.not_applied.setdefault(name, {"rows": 0, "reason": reason})
        entry["rows"] += rows

    def to_dict(self) -> dict:
        return {
            "files": len(self.files),
            "rows_read": self.rows_read,
            "kept": self.kept,
            "removed": dict(self.removed),
            "not_applied": self.not_applied,
            "language_detection": self.language_detection,
        }


class Deduplicator:
    """First occurrence wins, in row order: first the URLs of the rows that passed the filters,
    then the captions of the rows left. 64-bit hashes in numpy hash tables sized for
    `max_rows` (clipforge.data.dedup): ~9.4 bytes per row read and per set, whatever the strings."""

    def __init__(self, urls: bool, captions: bool, max_rows: int):
        self.urls = HashSet64(max_rows) if urls else None
        self.captions = HashSet64(max_rows) if captions else None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in (self.urls, self.captions) if s is not None)

    def keep(self, urls, captions) -> tuple[np.ndarray, int, int]:
        """(indices of the rows kept, duplicate URLs, duplicate captions) of a batch."""
        import pyarrow as pa

        kept = np.arange(len(urls))
        duplicate_urls = duplicate_captions = 0
        if self.urls is not None:
            kept = first_occurrences(hash_strings(urls), self.urls)
            duplicate_urls = len(urls) - len(kept)
        if self.captions is not None:
            left = captions.take(pa.array(kept, type=pa.int64()))
            unique = first_occurrences(hash_strings(left), self.captions)
            duplicate_captions = len(kept) - len(unique)
            kept = kept[unique]
        return kept, duplicate_urls, duplicate_captions


def find_columns(names: list[str]) -> dict[str, str | None]:
    by_lower = {n.lower(): n for n in names}
    return {role: by_lower.get(laion.lower()) for role, laion in COLUMNS.items()}


def utf8_text(column) -> tuple[Any, np.ndarray]:
    """(a text column as a string array, which rows were not UTF-8: null there). A binary column
    is checked as it is cast; a string column read from parquet is not checked by pyarrow, and a
    row that is not UTF-8 failed far from here (ArrowInvalid in a cast, UnicodeDecodeError when
    turned into Python). One bad row among 100M is skipped and counted, not the download refused:
    LAION's metadata is scraped alt text, and the other sources skip such captions too."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        raw = column.view(pa.large_binary() if pa.types.is_large_string(kind) else pa.binary())
    elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        raw = column
    else:  # numbers, or anything else pyarrow writes as text
        return pc.cast(column, pa.string()), np.zeros(len(column), dtype=bool)
    try:
        return raw.cast(pa.string()), np.zeros(len(column), dtype=bool)  # the cast validates
    except pa.ArrowInvalid:
        bad = np.array([value is not None and not _is_utf8(value) for value in raw.to_pylist()])
        kept = pc.if_else(pa.array(~bad), raw, pa.nulls(len(raw), raw.type))
        return kept.cast(pa.string()), bad


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def clean_captions(text):
    """Whitespace runs (Unicode separators included) -> one space, trimmed; as clean_caption."""
    import pyarrow.compute as pc

    return pc.utf8_trim_whitespace(pc.replace_substring_regex(text, r"[\s\p{Z}]+", " "))


def looks_chinese(captions):
    import pyarrow.compute as pc

    han = pc.count_substring_regex(captions, _HAN)
    other = pc.count_substring_regex(captions, _KANA_HANGUL)
    letters = pc.count_substring_regex(captions, _LETTER)
    return pc.and_(
        pc.and_(pc.greater(han, 0), pc.equal(other, 0)),
        pc.greater_equal(pc.multiply(han, 3), letters),
    )


def check_columns(
    file: str, cols: dict[str, str | None], names: list[str], data: DataConfig
) -> None:
    """Refuse a file the configured filters cannot work on, naming what is missing."""
    for role in ("url", "text"):
        if cols[role] is None:
            raise StageError(
                f"data.paths: {file} has no {COLUMNS[role]} column (columns: "
                f"{', '.join(names)}); laion-parquet expects LAION's column names"
            )
    if data.min_similarity > 0 and cols["similarity"] is None:
        raise StageError(
            f"data.min_similarity: {file} has no `similarity` column; set "
            f"data.min_similarity: 0 to download without that filter"
        )
    if data.language and data.language.lower() != "zh" and cols["language"] is None:
        raise StageError(
            f"data.language: {file} has no LANGUAGE column and script detection "
            f"knows only `zh`; use data.language: zh or null"
        )


def _passes(
    batch,
    cols: dict,
    data: DataConfig,
    urls,
    captions,
    not_utf8: np.ndarray,
    report: FilterReport,
    file: str,
) -> list[tuple[str, Any]]:  # (name, a pyarrow BooleanArray or None)
    """(filter name, boolean array of rows that pass, or None when not applied) in FILTERS order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = batch.num_rows

    def column(role: str):
        return batch.column(cols[role]) if cols[role] is not None else None

    def numeric(role: str):
        return pc.cast(column(role), pa.float64())

    def when(role_list: tuple[str, ...], enabled: bool, name: str, build):
        if not enabled:
            return None
        missing = [COLUMNS[r] for r in role_list if cols[r] is None]
        if missing:
            report.skip(name, rows, f"no {', '.join(missing)} column in {file}")
            return None
        return build()

    length = pc.utf8_length(captions)
    checks = [
        ("bad_url", pc.match_substring_regex(urls, r"^https?://\S+$", ignore_case=True)),
        ("caption_not_utf8", pa.array(~not_utf8)),
        ("empty_caption", pc.greater(length, 0)),
        ("caption_too_long", pc.less_equal(length, data.max_caption_chars)),
        (
            "low_similarity",
            when(
                ("similarity",),
                data.min_similarity > 0,
                "low_similarity",
                lambda: pc.greater_equal(numeric("similarity"), data.min_similarity),
            ),
        ),
    ]
    if data.language:
        if cols["language"] is not None:
            report.language_detection["LANGUAGE column"] = (
                report.language_detection.get("LANGUAGE column", 0) + rows
            )
            is_language = pc.equal(
                pc.utf8_lower(utf8_text(column("language"))[0]), data.language.lower()
            )
        else:
            report.language_detection["script"] = report.language_detection.get("script", 0) + rows
            is_language = looks_chinese(captions)
        checks.append(("not_language", is_language))
    else:
        checks.append(("not_language", None))

    def ratio():
        w, h = numeric("width"), numeric("height")
        return pc.less_equal(
            pc.divide(pc.max_element_wise(w, h), pc.min_element_wise(w, h)), data.max_aspect_ratio
        )

    checks += [
        (
            "unsafe",
            when(
                ("punsafe",),
                data.max_punsafe < 1.0,
                "unsafe",
                lambda: pc.less_equal(numeric("punsafe"), data.max_punsafe),
            ),
        ),
        (
            "watermarked",
            when(
                ("pwatermark",),
                data.max_pwatermark < 1.0,
                "watermarked",
                lambda: pc.less_equal(numeric("pwatermark"), data.max_pwatermark),
            ),
        ),
        (
            "too_small",
            when(
                ("width", "height"),
                data.min_image_side > 0,
                "too_small",
                lambda: pc.greater_equal(
                    pc.min_element_wise(numeric("width"), numeric("height")), data.min_image_side
                ),
            ),
        ),
        ("bad_aspect_ratio", when(("width", "height"), True, "bad_aspect_ratio", ratio)),
    ]
    return [(name, None if ok is None else pc.fill_null(ok, False)) for name, ok in checks]


def filter_batch(
    batch, cols: dict, data: DataConfig, dedup: Deduplicator, report: FilterReport, file: str
):
    """The kept rows of one record batch as a table (url, caption); counts go to `report`."""
    import pyarrow as pa

    text, not_utf8 = utf8_text(batch.column(cols["text"]))
    captions = clean_captions(text)
    every_url = utf8_text(batch.column(cols["url"]))[0]
    alive = np.ones(batch.num_rows, dtype=bool)
    checks = _passes(batch, cols, data, every_url, captions, not_utf8, report, file)
    for name, passes in checks:
        if passes is None:
            continue
        ok = passes.to_numpy(zero_copy_only=False)
        report.removed[name] += int(np.count_nonzero(alive & ~ok))
        alive &= ok
    survivors = pa.array(np.flatnonzero(alive), type=pa.int64())
    urls = every_url.take(survivors)
    captions = captions.take(survivors)
    keep, duplicate_urls, duplicate_captions = dedup.keep(urls, captions)
    report.removed["duplicate_url"] += duplicate_urls
    report.removed["duplicate_caption"] += duplicate_captions
    report.rows_read += batch.num_rows
    report.kept += len(keep)
    indices = pa.array(keep, type=pa.int64())
    return pa.table({"url": urls.take(indices), "caption": captions.take(indices)})


def filtered_tables(files: list[str], data: DataConfig, report: FilterReport) -> Iterator:
    """Stream every file batch by batch; yield the kept rows of each batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dedup = Deduplicator(data.dedup_urls, data.dedup_captions, _rows_in(files))
    for file in files:
        with open_input(file) as handle:
            try:
                parquet = pq.ParquetFile(handle)
            except (pa.ArrowInvalid, OSError) as exc:
                raise StageError(
                    f"data.paths: {file} is not a readable parquet file ({exc})"
                ) from None
            names = parquet.schema_arrow.names
            cols = find_columns(names)
            check_columns(file, cols, names, data)
            wanted = [c for c in cols.values() if c is not None]
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=wanted):
                yield filter_batch(batch, cols, data, dedup, report, file)


def _rows_in(files: list[str]) -> int:
    """Rows of every file, from the parquet footers: the most the de-duplication can keep."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    total = 0
    for file in files:
        with open_input(file) as handle:
            try:
                total += pq.ParquetFile(handle).metadata.num_rows
            except (pa.ArrowInvalid, OSError):
                pass  # reported when the stream reaches it, after the files before it
    return total
