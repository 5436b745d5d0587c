"""Input locations of the streaming sources: local paths, globs, `{000..099}` ranges, fsspec URLs.

`data.paths: [s3://bucket/laion-zh/part-*.parquet]` and `[/data/shards/{000000..000099}.tar]`
both become a sorted list of concrete files before anything is read, so a typo fails at once
and the order (hence the data) does not depend on how a filesystem lists a directory.
"""

from __future__ import annotations

from collections import Counter

from clipforge.errors import StageError

_GLOB_CHARS = set("*?[")


def expand_paths(patterns: list[str], what: str) -> list[str]:
    """Concrete files for data.paths, in a stable order; raises StageError naming a pattern
    that matches nothing."""
    import fsspec
    from braceexpand import braceexpand

    files: list[str] = []
    for pattern in patterns:
        for item in braceexpand(pattern):
            fs, path = fsspec.core.url_to_fs(item)
            local = "://" not in item
            if _GLOB_CHARS & set(path):
                matches = sorted(fs.glob(path))
                if not matches:
                    raise StageError(f"data.paths: {item} matches no file (expected {what})")
                files += [m if local else fs.unstrip_protocol(m) for m in matches]
            elif fs.isfile(path):
                files.append(item)
            elif fs.isdir(path):
                raise StageError(
                    f"data.paths: {item} is a directory; use a glob such as "
                    f"{item.rstrip('/')}/*{_suffix(what)}"
                )
            else:
                raise StageError(f"data.paths: {item} not found (expected {what})")
    duplicates = sorted(f for f, n in Counter(files).items() if n > 1)
    if duplicates:
        raise StageError(f"data.paths: {duplicates[0]} is listed more than once")
    return files


def _suffix(what: str) -> str:
    return ".parquet" if "parquet" in what else ".tar"


def open_input(url: str, mode: str = "rb"):
    """A file object for a path or fsspec URL (the caller closes it)."""
    import fsspec

    return fsspec.open(url, mode).open()
