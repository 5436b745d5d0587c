"""The data stage on N webdataset shards: copied (today's `source: webdataset`) against indexed in
place (data.in_place), per core and with every core, extrapolated to 100M pairs; and `dvc repro`
/ `dvc status` on each.

    .venv/bin/python bench/inplace_data.py [--pairs 8192] [--copies 8] [--skip-dvc]

The shards hold 256 px JPEGs of generated scenes (as LAION's after img2dataset; bench/gpu.py's
generator), 1024 pairs each; `--copies` hard-links each generated shard under that many names
(another name is another split of its keys, and costs no generating), so the stage's fixed
start-up is spread over pairs * copies. Each variant runs the real data stage
(`clipforge.data.stage.main`) into a fresh directory, timed whole (wall seconds, and CPU seconds
of this process and its children), copy and in place in the same run. In place, data.verify
`sample` decodes VERIFY_SAMPLE_SHARE of the images (also run at the 1% it was before);
data.decontaminate `drop` reads and pHashes every image (`+decontam`). Extrapolation: 100M /
(pairs per CPU-second), on one core and on 16 (the per-core rate times 16: shards are
independent, one per worker process); start-up included, so it errs long. Also: the scan alone
(`scan_shard`, in this process: the cost per pair without start-up) and the index's bytes per
pair. The `dvc` part builds a one-stage DVC project (`outs: - data`) around each variant and
times `dvc repro` (the stage, then DVC hashing and caching data/) and then `dvc status`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import make_shards  # noqa: E402 - the same shards as the GPU and loader benches

REPO = Path(__file__).resolve().parents[1]
TARGET_PAIRS = 100_000_000


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def variants(cores: int) -> dict[str, dict]:
    base = {"verify": "sample", "decontaminate": "off"}
    found = {
        "copy (today)": {"in_place": False, "decontaminate": "off"},
        "copy +decontam": {"in_place": False, "decontaminate": "drop"},
        "in place, 1 core": {"in_place": True, "workers": 1, **base},
        f"in place, {cores} cores": {"in_place": True, "workers": cores, **base},
        "in place, verify sample at 1%, 1 core": {"in_place": True, "workers": 1, **base}
        | {"verify_share": 0.01},
        "in place +decontam, 1 core": {"in_place": True, "workers": 1, **base}
        | {"decontaminate": "drop"},
        f"in place +decontam, {cores} cores": {"in_place": True, "workers": cores, **base}
        | {"decontaminate": "drop"},
        f"in place verify all, {cores} cores": {"in_place": True, "workers": cores}
        | {"verify": "all", "decontaminate": "off"},
    }
    return found


def params(shards: Path, test_dir: Path, knobs: dict) -> dict:
    return {
        "data": {
            "source": "webdataset",
            "paths": [f"{shards}/*.tar"],
            "test_dir": str(test_dir),
            "val_fraction": 0.01,
            **knobs,
        }
    }


def run_stage(root: Path, shards: Path, test_dir: Path, knobs: dict) -> dict:
    from clipforge.data import inplace
    from clipforge.data.stage import main

    knobs = dict(knobs)
    share = knobs.pop("verify_share", inplace.VERIFY_SAMPLE_SHARE)
    root.mkdir()
    (root / "params.yaml").write_text(yaml.safe_dump(params(shards, test_dir, knobs)), "utf-8")
    default_share, inplace.VERIFY_SAMPLE_SHARE = inplace.VERIFY_SAMPLE_SHARE, share  # forked on
    try:
        cpu, began = _cpu_seconds(), time.perf_counter()
        assert main(["--params", str(root / "params.yaml"), "--out", str(root / "data")]) == 0
        wall, cpu = time.perf_counter() - began, _cpu_seconds() - cpu
    finally:
        inplace.VERIFY_SAMPLE_SHARE = default_share
    data = root / "data"
    size = sum(p.stat().st_size for p in data.rglob("*") if p.is_file())
    row = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "data_dir_mb": round(size / 1e6, 1)}
    if knobs.get("in_place"):
        manifest = json.loads((data / "manifest.json").read_text("utf-8"))
        pairs = sum(manifest["splits"][s]["count"] for s in ("train", "val"))
        index = sum(p.stat().st_size for s in ("train", "val") for p in (data / s).glob("*.npz"))
        row["index_bytes_per_pair"] = round(index / pairs, 2)
        row["manifest_bytes_per_shard"] = round(
            (data / "manifest.json").stat().st_size / len(manifest["source"]["shards"])
        )
    return row


def scan_rate(files: list[Path], tmp: Path) -> dict:
    """scan_shard alone over the shards, in this process: pairs per CPU-second without the
    stage's start-up, with data.verify none and sample."""
    from clipforge.data.inplace import ScanOptions, scan_shard

    found = {}
    for verify in ("none", "sample"):
        options = ScanOptions(0, 0.01, 0.0, verify, False, 512, 10**8)
        began = time.process_time()
        pairs = 0
        for n, path in enumerate(files):
            index = {
                split: tmp / f"scan-{verify}" / split / f"{n:06d}.npz" for split in ("train", "val")
            }
            pairs += scan_shard(str(path), options, index).samples
        seconds = time.process_time() - began
        found[f"scan_only_verify_{verify}_pairs_per_cpu_s"] = round(pairs / seconds)
        found[f"scan_only_verify_{verify}_us_per_pair"] = round(seconds / pairs * 1e6, 2)
    return found


def time_dvc(root: Path, shards: Path, test_dir: Path, knobs: dict) -> dict:
    """`dvc repro` then `dvc status` in a fresh git + DVC project with one data stage."""
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    dvc = [str(Path(sys.executable).parent / "dvc")]
    (root / "params.yaml").write_text(yaml.safe_dump(params(shards, test_dir, knobs)), "utf-8")
    (root / "dvc.yaml").write_text(
        yaml.safe_dump(
            {
                "stages": {
                    "data": {
                        "cmd": f"{sys.executable} -m clipforge.data",
                        "params": ["data"],
                        "outs": ["data"],
                    }
                }
            }
        ),
        "utf-8",
    )
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([*dvc, "init", "-q"], cwd=root, check=True, env=env)
    shutil.copyfile(REPO / ".dvc" / "config", root / ".dvc" / "config")  # the link types
    timings = {}
    for name, argv in (("dvc_repro_s", ["repro", "-q"]), ("dvc_status_s", ["status", "-q"])):
        began = time.perf_counter()
        done = subprocess.run([*dvc, *argv], cwd=root, env=env, capture_output=True, text=True)
        assert done.returncode in (0, 1), done.stderr
        timings[name] = round(time.perf_counter() - began, 2)
    cache = root / ".dvc" / "cache"
    timings["dvc_cache_mb"] = round(
        sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6,
        1,
    )
    return timings


def textured_jpeg(seed: int) -> bytes:
    """A test image unlike the generated scenes (so decontamination has nothing to drop)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((160, 120))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8192, help="pairs generated")
    parser.add_argument("--copies", type=int, default=8, help="names per generated shard")
    parser.add_argument("--skip-dvc", action="store_true")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    from clipforge.data import testset

    results: dict = {"cores": cores}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tmp / "shards"
        files = make_shards(shards, args.pairs)
        for tar in sorted((shards / "train").glob("*.tar")):
            for copy in range(args.copies):  # hard links: another name, the same bytes
                os.link(tar, shards / f"c{copy:02d}-{tar.name}")
        shutil.rmtree(shards / "train")
        pairs = args.pairs * args.copies
        results |= {"pairs": pairs, "generated_pairs": args.pairs}
        results["shards"] = len(files.paths) * args.copies
        results["shard_mb"] = round(sum(p.stat().st_size for p in shards.glob("*.tar")) / 1e6)
        results |= scan_rate(sorted(shards.glob("*.tar")), tmp)
        testset.write_test_set(
            tmp / "test", [(i, textured_jpeg(i), [f"测试 {i}"]) for i in range(100)]
        )
        for number, (name, knobs) in enumerate(variants(cores).items()):
            row = run_stage(tmp / f"run-{number}", shards, tmp / "test", knobs)
            per_cpu_s = pairs / row["cpu_s"]
            row["pairs_per_s"] = round(pairs / row["wall_s"])
            row["pairs_per_cpu_s"] = round(per_cpu_s)
            row["hours_for_100M_on_1_core"] = round(TARGET_PAIRS / per_cpu_s / 3600, 3)
            row["minutes_for_100M_on_16_cores"] = round(
                TARGET_PAIRS / (per_cpu_s * 16) / 60 if knobs.get("in_place") else float("nan"),
                1,
            )
            if not args.skip_dvc and ("cores" not in name or name.endswith(f"{cores} cores")):
                if "decontam" not in name and "verify" not in name:
                    row |= time_dvc(tmp / f"dvc-{number}", shards, tmp / "test", knobs)
            results[name] = row
            print(name, row, file=sys.stderr)
        copy = results["copy (today)"]["pairs_per_cpu_s"]
        for name in ("in place, 1 core", "in place, verify sample at 1%, 1 core"):
            results[f"speedup per core: {name} / copy"] = round(
                results[name]["pairs_per_cpu_s"] / copy, 1
            )
        results["speedup per core: scan only, verify sample / copy"] = round(
            results["scan_only_verify_sample_pairs_per_cpu_s"] / copy, 1
        )
    json.dump(results, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
