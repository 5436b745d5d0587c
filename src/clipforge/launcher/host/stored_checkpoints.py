"""The newest checkpoint of every run on this host, as JSON: what `make down` must not lose.

Run on each worker as a script given whole (`python3 -c SOURCE [--retained DIR]... [--root DIR]...`,
SOURCE from `script_source`): standard library only, and so are the clipforge modules it imports
(the checkpoint names of clipforge.checkpoints.layout, the run record's reader), whose sources
`script_source` puts in front of its own, since the runs on a host may hold any version of the
code and none need be importable there.

Runs live under run roots: each root `fab train` recorded on this host (RUN_ROOTS_FILE in the
home directory, one absolute path a line), and each --root given. In a root, every run's
checkpoints directories (run.json's `checkpoints_dir`, and each node checkout's checkpoints/)
hold one `run-<id>/` per training run, whose `latest` names its newest checkpoint (a hint: with
none, or one that names no checkpoint, the newest finished checkpoint). For each such checkpoint the output gives its real path (symlinks resolved), the --retained directory it lies
under, and, when it lies under none, the md5 of each of its files: the caller looks for those in
the DVC remote (DVC 3 stores a file under its md5). With the run's store (RunRecord.store_remote),
the caller also looks there.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib
import json
import os
import sys

from clipforge.checkpoints import layout
from clipforge.launcher.host.record import RunRecordError, read_record

RUN_ROOTS_FILE = ".clipforge/run-roots"  # under the home directory
_MD5_CHUNK_BYTES = 8 * 2**20


def recorded_roots() -> list[str]:
    try:
        with open(os.path.join(os.path.expanduser("~"), RUN_ROOTS_FILE), encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    except FileNotFoundError:
        return []


def checkpoints_dirs(root: str) -> list[tuple[str, str, str | None]]:
    """(launch id, checkpoints directory, run store or None) of every run under `root`."""
    found = []
    for run_dir in sorted(glob.glob(os.path.join(root, "runs", "*"))):
        run = os.path.basename(run_dir)
        candidates = glob.glob(os.path.join(run_dir, "node-*", "code", "checkpoints"))
        try:
            record = read_record(os.path.join(run_dir, "run.json"))
        except RunRecordError:  # damaged: its checkpoints are still listed, with no store
            record = None
        if record is not None:
            candidates.append(record.checkpoints_dir)
        store = record.store_remote if record is not None else None
        found += [(run, path, store) for path in sorted(set(candidates)) if os.path.isdir(path)]
    return found


# What the script imports of clipforge, and the modules they import, in import order: each
# standard library only.
_INLINED = (
    "clipforge.errors",
    "clipforge.util",
    "clipforge.checkpoints.layout",
    "clipforge.launcher.host.record",
)
_IMPORTS = """\
from clipforge.checkpoints import layout
from clipforge.launcher.host.record import RunRecordError, read_record
"""
_PRELUDE = """\
import sys as _sys
import types as _types

for _name, _source in _INLINED_SOURCES.items():
    _parts = _name.split(".")
    for _depth in range(1, len(_parts)):  # the packages above it, as empty ones
        _package = ".".join(_parts[:_depth])
        if _package not in _sys.modules:
            _sys.modules[_package] = _types.ModuleType(_package)
            _sys.modules[_package].__path__ = []
    _module = _types.ModuleType(_name)
    _sys.modules[_name] = _module
    exec(compile(_source, _name, "exec"), _module.__dict__)
    setattr(_sys.modules[".".join(_parts[:-1])], _parts[-1], _module)
"""


def script_source() -> str:
    """This module's source, runnable by `python3 -c` where clipforge is not importable: in place
    of its clipforge imports, the sources of those modules run, registered under their names."""
    sources = {}
    for name in (*_INLINED, __name__):
        with open(importlib.import_module(name).__file__ or "", encoding="utf-8") as f:
            sources[name] = f.read()
    own = sources.pop(__name__)
    assert _IMPORTS in own, "stored_checkpoints imports clipforge in one known block"
    return own.replace(_IMPORTS, f"_INLINED_SOURCES = {sources!r}\n" + _PRELUDE + _IMPORTS, 1)


def newest_tag(training_run_dir: str) -> str | None:
    """The tag `latest` names; without a readable one, the newest checkpoint whose save finished
    (its manifest is there), or the newest checkpoint folder."""
    try:
        with open(os.path.join(training_run_dir, layout.LATEST), encoding="utf-8") as f:
            tag = layout.marker_tag(f.read())
    except (OSError, UnicodeDecodeError):
        tag = None
    if tag:
        return tag
    tags = sorted(
        (n for n in os.listdir(training_run_dir) if layout.tag_step(n) is not None),
        key=layout.step_of,
    )
    finished = [
        t
        for t in tags
        if os.path.isfile(os.path.join(training_run_dir, t, layout.CHECKPOINT_MANIFEST))
    ]
    candidates = finished or tags
    return candidates[-1] if candidates else None


def describe(
    launch_id: str, training_run_dir: str, retained: list[str], store: str | None = None
) -> dict:
    """The newest checkpoint of one training run (`run_id`) of launch `launch_id`: where it
    really is, and whether retained."""
    tag = newest_tag(training_run_dir) or layout.LATEST
    path = os.path.realpath(os.path.join(training_run_dir, tag))
    entry: dict[str, object] = {
        "launch_id": launch_id,
        "run_id": os.path.basename(training_run_dir),
        "tag": tag,
        "path": path,
        "retained": None,
        "md5": None,
        "problem": None,
        "store": store,
    }
    files = sorted(os.path.join(top, name) for top, _, names in os.walk(path) for name in names)
    if not files:
        entry["problem"] = (
            f"`latest` names {tag}, which is missing or empty"
            if layout.tag_step(tag) is not None
            else f"`{layout.LATEST}` names no checkpoint"
        )
        return entry
    for directory in retained:
        real = os.path.realpath(directory)
        if path == real or path.startswith(real.rstrip("/") + "/"):
            entry["retained"] = directory
            return entry
    entry["md5"] = {os.path.relpath(name, path): _md5(name) for name in files}
    return entry


def _md5(path: str) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_MD5_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def newest_checkpoints(roots: list[str], retained: list[str]) -> list[dict]:
    entries = []
    for root in dict.fromkeys(os.path.expanduser(r) for r in roots):
        for run, directory, store in checkpoints_dirs(root):
            for training_run_dir in sorted(glob.glob(os.path.join(directory, "run-*", ""))):
                training_run_dir = training_run_dir.rstrip("/")
                if newest_tag(training_run_dir) or os.path.lexists(
                    os.path.join(training_run_dir, layout.LATEST)
                ):
                    entries.append(describe(run, training_run_dir, retained, store))
    return entries


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--retained", action="append", default=[], help="retained storage")
    parser.add_argument("--root", action="append", default=[], help="a run root to look in too")
    args = parser.parse_args(argv)
    print(json.dumps(newest_checkpoints(recorded_roots() + args.root, args.retained)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
