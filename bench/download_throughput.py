"""Download-and-shard throughput: clipforge's laion-parquet data stage vs plain img2dataset.

Both fetch the same N images from a local HTTP server on 127.0.0.1 (tests/support/imageserver.py, the
test suite's server; images generated and cached before timing) with the same img2dataset
options (clipforge.data.download.command), so the difference is what the stage adds around
img2dataset: streaming the LAION metadata through the filters, and re-writing the shards into
data/train + data/val with the manifest. A third row runs img2dataset with its own defaults
(EXIF extraction on), the command a user would type without clipforge.

    .venv/bin/python bench/download_throughput.py --images 3000 --repeats 2

Prints a Markdown table for BENCHMARKS.md. Needs `make img2dataset-env` (or
CLIPFORGE_IMG2DATASET). Wall time includes each tool's start-up (img2dataset spawns its worker
and logger processes: ~10-15 s of fixed cost), as a user would see it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import yaml  # noqa: E402

from clipforge.data import download  # noqa: E402
from clipforge.data.config import DataConfig  # noqa: E402
from tests.support.imageserver import ImageServer  # noqa: E402

IMAGE_SIZE = (320, 240)


def options(args) -> dict:
    return {
        "download_processes": args.processes,
        "download_threads": args.threads,
        "download_samples_per_shard": args.rows_per_shard,
        "download_timeout_seconds": 10,
        "download_retries": 0,
        "val_fraction": 0.02,
        "test_fraction": 0.02,
        "samples_per_shard": args.rows_per_shard,
    }


def run_plain(executable: str, rows: list[dict], work: Path, args, defaults: bool) -> float:
    work.mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist([{"url": r["URL"], "caption": r["TEXT"]} for r in rows]),
        work / "input.parquet",
    )
    data = DataConfig(**options(args))
    if defaults:  # what a user types: img2dataset's own defaults besides the essentials
        argv = [
            executable,
            f"--url_list={work / 'input.parquet'}",
            "--input_format=parquet",
            "--url_col=url",
            "--caption_col=caption",
            "--output_format=webdataset",
            f"--output_folder={work / 'out'}",
            f"--processes_count={args.processes}",
            f"--thread_count={args.threads}",
            f"--number_sample_per_shard={args.rows_per_shard}",
        ]
    else:
        argv = download.command(executable, work / "input.parquet", work / "out", data)
    began = time.perf_counter()
    subprocess.run(
        argv,
        check=True,
        env=download.tool_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - began


def run_stage(executable: str, rows: list[dict], work: Path, args) -> float:
    work.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), work / "meta.parquet")
    params = {
        "data": {"source": "laion-parquet", "paths": [str(work / "meta.parquet")], **options(args)}
    }
    (work / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    env = dict(
        os.environ,
        CLIPFORGE_IMG2DATASET=executable,
        PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "clipforge.data"],
        cwd=work,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    elapsed = time.perf_counter() - began
    manifest = json.loads((work / "data" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["source"]["download"]["successes"] == len(rows), manifest["skipped"]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--rows-per-shard", type=int, default=1000)
    args = parser.parse_args()
    executable = download.find_img2dataset()
    times: dict[str, list[float]] = {
        "clipforge data stage (filter + img2dataset + re-shard)": [],
        "img2dataset, same options": [],
        "img2dataset, its defaults (EXIF on)": [],
    }
    with ImageServer() as server, tempfile.TemporaryDirectory() as tmp:
        rows = []
        for i in range(args.images):
            server.sizes[f"b{i}"] = IMAGE_SIZE
            server._image(f"b{i}")  # generate now: timing measures transfer, not our generator
            rows.append(
                {
                    "URL": server.url("img", f"b{i}"),
                    "TEXT": f"第{i}张图片：一只猫在沙发上",
                    "similarity": 0.4,
                    "WIDTH": IMAGE_SIZE[0],
                    "HEIGHT": IMAGE_SIZE[1],
                }
            )
        for repeat in range(args.repeats):
            root = Path(tmp) / f"r{repeat}"
            runs = [
                (
                    "clipforge data stage (filter + img2dataset + re-shard)",
                    lambda w: run_stage(executable, rows, w, args),
                ),
                (
                    "img2dataset, same options",
                    lambda w: run_plain(executable, rows, w, args, defaults=False),
                ),
                (
                    "img2dataset, its defaults (EXIF on)",
                    lambda w: run_plain(executable, rows, w, args, defaults=True),
                ),
            ]
            if repeat % 2:
                runs.reverse()  # alternate the order: neither side always runs on a warm cache
            for i, (name, run) in enumerate(runs):
                times[name].append(run(root / str(i)))
    print(
        f"{args.images} images of {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} px (JPEG), "
        f"{args.processes} processes x {args.threads} threads, {args.rows_per_shard} rows/shard, "
        f"median of {args.repeats}; {os.cpu_count()} CPUs, {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end; {download.tool_version(executable)}\n"
    )
    print("| pipeline | wall s (median) | images/s | runs (s) |")
    print("|---|---:|---:|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"| {name} | {median:.1f} | {args.images / median:.0f} | "
            f"{', '.join(f'{v:.1f}' for v in values)} |"
        )


if __name__ == "__main__":
    main()
