"""laion-parquet, step 2: the filtered rows -> webdataset shards, by img2dataset run as a tool.

img2dataset pins `webdataset<0.3` (and albumentations<2, pandas<3, wandb), which would drag
clipforge's training stack back, so it lives in a virtual environment of its own
(`make img2dataset-env` -> .venv-img2dataset) and is run as the `img2dataset` command. Found,
in order: $CLIPFORGE_IMG2DATASET, ./.venv-img2dataset/bin/img2dataset, `img2dataset` on PATH.

What img2dataset leaves in its output folder, per shard of `download_samples_per_shard` rows:
  00000.tar           successes: <key>.jpg, <key>.txt, <key>.json (key = shard * 10^k + row)
  00000.parquet       every row of the shard: key, url, caption, status, error_message
  00000_stats.json    written last: the shard is complete
Rerun with the same input, `--incremental_mode incremental` skips shards that have their stats
file and downloads the others again from their first row: an interrupted shard is redone whole,
so a sample is never written twice and keys stay the same.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from clipforge.cli import exit_on_stop_signals
from clipforge.data.config import DataConfig
from clipforge.errors import StageError

log = logging.getLogger("clipforge.data")

ENV_VAR = "CLIPFORGE_IMG2DATASET"
TOOL_VENV = ".venv-img2dataset"
_STOP_GRACE_SECONDS = 10


def find_img2dataset() -> str:
    override = os.environ.get(ENV_VAR)
    if override:
        if not os.access(override, os.X_OK):
            raise StageError(f"{ENV_VAR}={override} is not an executable file")
        return override
    candidate = Path(TOOL_VENV) / "bin" / "img2dataset"
    if candidate.is_file():
        return str(candidate.resolve())
    found = shutil.which("img2dataset")
    if found:
        return found
    raise StageError(
        f"img2dataset not found: run `make img2dataset-env` (creates {TOOL_VENV}/), "
        f"or set {ENV_VAR} to the img2dataset command of another environment"
    )


def tool_version(executable: str) -> str:
    """From the tool environment's package metadata (no interpreter start-up)."""
    site_packages = [
        str(path)
        for path in Path(executable).resolve().parent.parent.glob("lib/python*/site-packages")
    ]
    versions = {}
    for name in ("img2dataset", "webdataset"):
        found = next(iter(importlib.metadata.distributions(name=name, path=site_packages)), None)
        if found is not None:
            versions[name] = found.version
    if "img2dataset" not in versions:
        return "img2dataset (version unknown)"
    return f"img2dataset {versions['img2dataset']} (webdataset {versions.get('webdataset', '?')})"


def tool_env() -> dict:
    """The tool's environment: none of ours leaks in (a PYTHONPATH with a newer webdataset would
    shadow the pinned one), and no network calls besides the downloads themselves."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled", WANDB_SILENT="true")
    return env


def command(executable: str, input_file: Path, output_dir: Path, data: DataConfig) -> list[str]:
    options = {
        "url_list": input_file,
        "input_format": "parquet",
        "url_col": "url",
        "caption_col": "caption",
        "output_format": "webdataset",
        "output_folder": output_dir,
        "processes_count": data.download_processes,
        "thread_count": data.download_threads,
        "number_sample_per_shard": data.download_samples_per_shard,
        "image_size": data.download_image_size,
        "resize_mode": data.resize_mode,
        "resize_only_if_bigger": data.resize_only_if_bigger,
        "encode_format": "jpg",
        # a JPEG that needs no resizing keeps its bytes: no second lossy encoding, less CPU
        "skip_reencode": True,
        # neither EXIF nor a hash of the original is used downstream: CPU spent for nothing
        "compute_hash": None,
        "timeout": data.download_timeout_seconds,
        "retries": data.download_retries,
        "min_image_size": data.min_image_side,
        "max_image_area": data.max_image_pixels,
        "max_aspect_ratio": data.max_aspect_ratio,
        "extract_exif": False,
        "incremental_mode": "incremental",
        "enable_wandb": False,
    }
    return [executable, *(f"--{name}={value}" for name, value in options.items())]


class Running:
    """img2dataset at work in its own process group; shards can be taken as they finish."""

    def __init__(self, process: subprocess.Popen, output_dir: Path, log_file: Path):
        self.process = process
        self.output_dir = output_dir
        self.log_file = log_file

    def wait_for_shard(self, shard: str, poll_seconds: float = 0.2) -> None:
        """Return once the shard's stats file exists: img2dataset closes the .tar and .parquet
        before it writes the stats, so both are complete then."""
        stats = self.output_dir / f"{shard}_stats.json"
        while not stats.exists():
            if self.process.poll() is not None:
                if stats.exists():
                    return
                self.check_exit()
                raise StageError(
                    f"img2dataset ended without finishing shard {shard} (see "
                    f"{self.log_file}); rerun the data stage to retry it"
                )
            time.sleep(poll_seconds)

    def check_exit(self) -> None:
        code = self.process.wait()
        if code != 0:
            tail = self.log_file.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
            raise StageError(
                f"img2dataset exited with code {code}; the end of {self.log_file}:\n"
                + "\n".join(tail)
            )


@contextlib.contextmanager
def running(argv: list[str], output_dir: Path, log_file: Path) -> Iterator[Running]:
    """Start img2dataset; the body consumes shards while it downloads the next ones. On leaving,
    wait for it to end; on an error or SIGTERM/SIGINT (which end the stage with 128 + signal,
    ready to be rerun), stop its whole process group, pool and logger processes included."""
    with open(log_file, "ab") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=tool_env(), start_new_session=True
        )
    try:
        with exit_on_stop_signals():
            job = Running(process, output_dir, log_file)
            yield job
            job.check_exit()
    finally:
        if process.poll() is None:
            _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    log.warning(
        "stopping img2dataset (process group %d); rerun to continue the download", process.pid
    )
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=_STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


@dataclass(frozen=True)
class ShardStats:
    shard: str  # img2dataset's shard name, e.g. "00000"
    count: int
    successes: int
    failed_to_download: int
    failed_to_resize: int
    duration_seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def finished_shards(output_dir: Path) -> list[str]:
    return sorted(p.name.removesuffix("_stats.json") for p in output_dir.glob("*_stats.json"))


def shard_stats(output_dir: Path, expected: int) -> list[ShardStats]:
    """Per-shard stats of a finished download; StageError when img2dataset left shards undone."""
    names = finished_shards(output_dir)
    if len(names) != expected:
        raise StageError(
            f"img2dataset finished {len(names)} of {expected} shards in {output_dir} "
            f"(see img2dataset.log there); rerun the data stage to retry the rest"
        )
    stats = []
    for name in names:
        raw = json.loads((output_dir / f"{name}_stats.json").read_text(encoding="utf-8"))
        stats.append(
            ShardStats(
                name,
                raw["count"],
                raw["successes"],
                raw["failed_to_download"],
                raw["failed_to_resize"],
                round(raw["duration"], 3),
            )
        )
    return stats


@dataclass(frozen=True)
class SampleStatus:
    key: str
    url: str
    caption: str
    status: str  # success, failed_to_download, failed_to_resize
    error_message: str | None


def sample_statuses(output_dir: Path, shard: str) -> Iterator[SampleStatus]:
    """Every row of a shard, in key order (img2dataset writes them in completion order)."""
    import pyarrow.parquet as pq

    table = pq.read_table(
        output_dir / f"{shard}.parquet",
        columns=["key", "url", "caption", "status", "error_message"],
    )
    rows = sorted(table.to_pylist(), key=lambda row: row["key"])
    for row in rows:
        yield SampleStatus(
            row["key"], row["url"], row["caption"], row["status"], row["error_message"]
        )


_HTTP_STATUS = re.compile(r"HTTP Error (\d{3})")
_RESIZE_REASONS = {
    "image too small": "too_small",
    "image area too large": "too_large",
    "aspect ratio too large": "bad_aspect_ratio",
}


def skip_reason(status: str, error_message: str | None) -> str:
    """img2dataset's status + message of a failed row -> clipforge's skip reason."""
    message = error_message or ""
    if status == "failed_to_resize":
        return _RESIZE_REASONS.get(message, "corrupt_image")
    http = _HTTP_STATUS.search(message)
    if http:
        return "not_found" if http.group(1) in ("404", "410") else "http_error"
    if "timed out" in message.lower():
        return "timeout"
    if "X-Robots-Tag" in message:
        return "opted_out"
    if "urlopen error" in message or "Connection" in message:
        return "unreachable"
    return "download_failed"
