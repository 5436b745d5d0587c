"""`fab publish RUN --to URL` and `fab pull URL`: a trained model handed on, and fetched back verified.

A published model is a hub-style folder at any fsspec URL (a local folder, s3://, ...):

  <url>/README.md                     the model card: environment, metrics, the `fab rerun` line
  <url>/open_clip_config.json, open_clip_model.safetensors, clipforge_config.yaml, ...
                                      the open_clip export (open_clip's `local-dir:` layout)
  <url>/transformers/                 the transformers export, where the run wrote one
  <url>/clipforge.json                the run, its data manifest's sha256, environment, metrics
  <url>/SHA256SUMS                    `<sha256>  <path>` of every other file, written last

`pull` copies it into a local folder and checks every file against SHA256SUMS before the folder
appears: what `open_clip.create_model_and_transforms("local-dir:FOLDER")` loads is what was
published, or nothing.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Callable
from pathlib import Path

from clipforge.errors import UserError
from clipforge.export.card import CARD_FILE
from clipforge.fsutil import replace_dir_atomically, sha256_file
from clipforge.repro.run_folder import RunFolder
from clipforge.store.remote import open_filesystem

CHECKSUMS = "SHA256SUMS"
RECORD = "clipforge.json"
EVAL_CARD = "metrics/model-card.md"  # the card with eval's metrics (clipforge.eval.stage)


class PublishError(UserError):
    """A publish or pull that cannot go on; the message says why."""


def _sha256(data: bytes | Path) -> str:
    return sha256_file(data) if isinstance(data, Path) else hashlib.sha256(data).hexdigest()


def checksums_text(sums: dict[str, str]) -> str:
    return "".join(f"{digest}  {path}\n" for path, digest in sorted(sums.items()))


def parse_checksums(text: str) -> dict[str, str]:
    sums = {}
    for number, line in enumerate(text.splitlines(), 1):
        digest, sep, path = line.partition("  ")
        if not sep or len(digest) != 64 or not path or path.startswith("/") or ".." in path:
            raise PublishError(f"{CHECKSUMS} line {number}: not `<sha256>  <path>`: {line!r}")
        sums[path] = digest
    return sums


def published_files(run: RunFolder, rerun_line: str | None) -> dict[str, bytes | Path]:
    """Every file of the published folder but SHA256SUMS, by its path there: a local file to
    copy, or the bytes to write."""
    files: dict[str, bytes | Path] = {
        path.relative_to(run.model_dir).as_posix(): path
        for path in sorted(run.model_dir.rglob("*"))
        if path.is_file()
    }
    eval_card = run.path / EVAL_CARD
    if eval_card.is_file():  # the export's card with eval's metrics in it
        files[CARD_FILE] = eval_card
    record = {
        "run": run.info.get("run_id"),
        "launch_id": run.launch_id,
        "rerun": rerun_line,
        "data_manifest_sha256": run.data_manifest_sha256,
        "weights_sha256": run.weights_sha256,
        "metrics": run.metrics,
        "environment": run.environment,
    }
    files[RECORD] = (json.dumps(record, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files


def publish(run: RunFolder, url: str, rerun_line: str | None, say: Callable[[str], None]) -> None:
    fs, root = open_filesystem(url)
    if fs.exists(posixpath.join(root, CHECKSUMS)):
        raise PublishError(f"{url}: a model is already published there; choose another --to")
    files = published_files(run, rerun_line)
    for path, data in files.items():
        target = posixpath.join(root, path)
        if isinstance(data, Path):
            fs.put_file(str(data), target)
        else:
            fs.pipe_file(target, data)
    # last: a folder with SHA256SUMS is a whole one
    sums = {path: _sha256(data) for path, data in files.items()}
    fs.pipe_file(posixpath.join(root, CHECKSUMS), checksums_text(sums).encode("utf-8"))
    say(f"published {run.path} to {url}: {len(files)} files and {CHECKSUMS}")
    say(f'load it: fab pull {url} --to DIR, then open_clip "local-dir:DIR"')


def pull(url: str, destination: Path, say: Callable[[str], None]) -> Path:
    """The published folder at url into destination, every file verified, or nothing there."""
    fs, root = open_filesystem(url)
    sums_path = posixpath.join(root, CHECKSUMS)
    if not fs.exists(sums_path):
        raise PublishError(f"{url}: no {CHECKSUMS}: not a published model (or one cut short)")
    sums = parse_checksums(fs.cat_file(sums_path).decode("utf-8"))
    with replace_dir_atomically(destination) as tmp:
        for path, digest in sums.items():
            target = tmp / path
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                fs.get_file(posixpath.join(root, path), str(target))
            except FileNotFoundError:
                raise PublishError(f"{url}: {path} is listed in {CHECKSUMS} but missing") from None
            if _sha256(target) != digest:
                raise PublishError(
                    f"{url}: {path} does not match its sha256 in {CHECKSUMS}: damaged or changed "
                    "since it was published; nothing was pulled"
                )
        (tmp / CHECKSUMS).write_text(checksums_text(sums), encoding="utf-8")
    say(f"pulled {url} into {destination}: {len(sums)} files verified")
    return destination
