"""The train stage on a GPU, measured side by side with plain PyTorch and open_clip_train.

    bench/gpu-run.sh OUT_DIR             # on a GPU machine (installs missing wheels first)
    python bench/gpu.py --out DIR --dry-run   # the same code on CPU with a tiny model (make test)

Device time is scarce (one 8-minute run may be all there is), so the sections run in order of
value per second of device time, each under a time budget, each row guarded: a failure is
recorded with its first error line and the rest runs. DIR/gpu-bench.json and gpu-bench.md are
rewritten after every row, so a run cut short still leaves everything it measured.
  env         nproc, /dev/shm, driver, clocks, versions; the datasheet part and peak, a measured
              bf16 matmul rate (warmed 0.5 s, timed over 0.2 s at least), model FLOPs per sample
  zero1       clipforge's step (ZeRO-1, eager) on in-memory batches by micro batch, and with
              gradient checkpointing
  losses      the same step at the best ZeRO-1 micro batch with SigLIP's loss (train.loss:
              siglip) and with a frozen teacher (train.distill_model, bf16), each against the
              plain step measured beside it
  reference   the same model, batches and precision: (1) a plain-PyTorch step (open_clip model,
              ClipLoss, bf16 autocast, fused AdamW, no DeepSpeed); (2) open_clip_train's own
              loop, `--dataset-type synthetic`, in a process of its own (end to end only: its
              per-step times are not synchronised with the GPU, see open_clip_train_row)
  end_to_end  clipforge's best ZeRO-1 row fed by the real loader
  zero23      one ZeRO-2 and one ZeRO-3 row, each in a fresh process (ZeRO-3 patches torch's
              linear for the whole process it runs in)
  compile     one ZeRO-1 row with torch.compile at micro = global batch (one graph, one cold
              compile), in a fresh process
  loader      the loader alone by worker count, and batched decode_jpeg on the device
  train_run   `python -m clipforge.train` for real: stopped by SIGTERM mid-run, resumed,
              finished; the loss falls and the export loads in plain open_clip

DeepSpeed is imported only by the rows that use it: when it cannot be imported (or its process
group cannot start), those rows record why and the plain-PyTorch, open_clip_train and loader
rows still run.

The dry run executes every section's code at tiny sizes (torch.compile with the `aot_eager`
backend: dynamo's graphs and AOTAutograd's backward, no code generated, no C++ toolchain needed),
so an import or API error cannot hide behind the GPU.
Rates are timed over windows much longer than what can be in flight (loader chunks, prefetched
steps), so prefetching cannot inflate them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

SECTIONS = (
    "env", "zero1", "losses", "reference", "end_to_end", "zero23", "compile", "loader", "train_run"
)  # fmt: skip
# The sections whose rows run DeepSpeed's engine (the train stage's included).
DEEPSPEED_SECTIONS = ("zero1", "losses", "end_to_end", "zero23", "compile", "train_run")


@dataclass(frozen=True)
class Profile:
    device: str
    model: str
    teacher: str  # the losses section's distillation teacher (train.distill_model)
    image_size: int
    num_images: int
    global_batch: int
    zero1_micro_batches: tuple[int, ...]
    zero23_micro_batch: int  # one row per stage
    compile_micro_batch: int  # one row: the global batch, so one graph is compiled
    compile_backend: str
    warmup_steps: int
    timed_steps: int
    worker_counts: tuple[int, ...]
    loader_min_chunks: int  # chunks timed per worker count, at least (and 4x what is in flight)
    end_to_end_workers: int
    end_to_end_steps: int  # timed, after warmup_steps
    open_clip_workers: int
    open_clip_steps: int  # logged steps of open_clip_train's loop; the first warmup_steps dropped
    run_steps: int  # train_run: steps of the real run; it is stopped after `run_hold_step`
    run_hold_step: int
    run_save_every: int
    run_batch: int
    run_images: int
    run_precision: str  # the GPU default's (auto: bf16); the dry run asks for bf16 on the CPU
    total_seconds: float  # everything; the device tool's limit is 470 s, wheels included
    section_seconds: dict = field(default_factory=dict)  # caps; train_run gets what is left
    # DeepSpeed's import and process group, and the model's build (each): seconds on a GPU; on a
    # CPU the first start builds DeepSpeed's CPU comm op (minutes on a busy machine)
    setup_seconds: float = 60.0
    train_run_min_seconds: float = 0.0  # below this much time left, train_run is not started


PREFETCH = 4  # the loader's prefetch factor here (the train stage's MAX_PREFETCH)
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_WORKERS = max(1, min(15, _CPUS - 1))

FULL = Profile(
    device="cuda",
    model="ViT-B-32",
    teacher="ViT-B-16",  # the recipe distill-b32-from-b16's
    image_size=224,
    num_images=8192,
    global_batch=1024,
    zero1_micro_batches=(1024, 512, 256),
    zero23_micro_batch=1024,
    compile_micro_batch=1024,
    compile_backend="inductor",
    warmup_steps=4,
    timed_steps=20,
    worker_counts=tuple(sorted({2, 8, _WORKERS})),
    loader_min_chunks=96,
    end_to_end_workers=_WORKERS,
    end_to_end_steps=24,  # 24 x 16 chunks: 6x the 60 that 15 workers can hold in flight
    open_clip_workers=_WORKERS,
    open_clip_steps=24,
    run_steps=16,
    run_hold_step=10,
    run_save_every=8,  # a ViT-B/32 checkpoint is about 2 GB: saves at 8, 10 (the stop), 16
    run_batch=256,
    run_images=4096,
    run_precision="auto",
    total_seconds=430,
    # Caps, in the order the sections run; they sum to the total less the train run's least.
    # Estimates on an H200 are about half of each (one cold inductor compile of ViT-B/32 about
    # 60 s); a cap bites only on a hang or a slow compile, and then the sections after it still
    # get theirs. end_to_end's cap includes making its shards.
    section_seconds={
        "env": 25,
        "zero1": 60,
        "losses": 35,
        "reference": 55,
        "end_to_end": 45,
        "zero23": 45,
        "compile": 75,
        "loader": 30,
    },
    train_run_min_seconds=60,
)
DRY = Profile(
    device="cpu",
    model="clipforge-tiny",
    teacher="clipforge-tiny",
    image_size=64,
    num_images=96,
    global_batch=16,
    zero1_micro_batches=(16, 8),
    zero23_micro_batch=16,
    compile_micro_batch=16,
    compile_backend="aot_eager",
    warmup_steps=1,
    timed_steps=2,
    worker_counts=(0, 1),
    loader_min_chunks=6,
    end_to_end_workers=1,
    end_to_end_steps=3,
    open_clip_workers=1,
    open_clip_steps=4,
    run_steps=8,
    run_hold_step=5,
    run_save_every=4,
    run_batch=16,
    run_images=160,
    run_precision="bf16",
    total_seconds=1800,
    setup_seconds=900,
    section_seconds={s: 600 for s in SECTIONS if s != "train_run"},
)
SHARD_SAMPLES = 1024
JPEG_SIDE = 256  # LAION as img2dataset resizes it: the loader's real input


# -- guards -------------------------------------------------------------------------------------


class OutOfTime(Exception):
    """A section's or the whole run's time budget ran out."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


@contextlib.contextmanager
def time_limit(seconds: float):
    """OutOfTime raised in this (main) thread after `seconds`: a hung row cannot take the run."""
    if seconds <= 0:
        raise OutOfTime("no time left")

    def expire(signum, frame):
        raise OutOfTime(f"over its {seconds:.0f} s budget")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Clock:
    def __init__(self, total_seconds: float):
        self.deadline = time.monotonic() + total_seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def attempt(seconds: float, fn, *args) -> dict:
    """fn(*args) under a time limit; {"error": its first line} instead of raising (the
    traceback goes to the log)."""
    try:
        with time_limit(seconds):
            return fn(*args)
    except Exception as exc:  # noqa: BLE001 - an OOM, a compile failure or a timeout is a result
        traceback.print_exc()
        return {"error": first_line(exc)}


class Report:
    """The results so far, rewritten as JSON and markdown after every row."""

    def __init__(self, out: Path, profile: Profile, dry_run: bool):
        self.out = out
        self.data: dict = {"profile": profile.__dict__, "dry_run": dry_run}

    def add(self, section: str, value) -> None:
        self.data[section] = value
        self._write()
        print(f"[bench] {section}: {json.dumps(value)[:400]}", flush=True)

    def row(self, section: str, row: dict) -> None:
        self.data.setdefault(section, []).append(row)
        self._write()
        print(f"[bench] {section} row: {json.dumps(row)[:400]}", flush=True)

    def _write(self) -> None:
        """Each file replaced whole (a run killed mid-write leaves the previous one)."""
        from clipforge.fsutil import atomic_write_text

        self.data["ratios"] = ratios(self.data)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out / "gpu-bench.json", json.dumps(self.data, indent=2) + "\n")
        atomic_write_text(self.out / "gpu-bench.md", markdown(self.data))


# -- the table ----------------------------------------------------------------------------------


def _rate(row) -> float | None:
    return row.get("samples_per_s") if isinstance(row, dict) else None


def _ref(data: dict, name: str) -> dict:
    return next((r for r in data.get("reference", []) if r.get("name") == name), {})


def ratios(data: dict) -> dict:
    """clipforge's step and end-to-end rates over the references measured in the same run."""
    step = _best(data.get("zero1", []))
    e2e = _rate(data.get("end_to_end"))
    plain = _rate(_ref(data, "plain_pytorch"))
    oc = _ref(data, "open_clip_train")
    loader = data.get("loader", [])
    e2e_workers = data.get("end_to_end", {}).get("workers")
    loader_rate = next(
        (r.get("images_per_s") for r in loader if r.get("workers") == e2e_workers), None
    )

    def over(a, b):
        return a / b if a and b else None

    return {
        "step_over_plain_pytorch": over(step, plain),
        # no step-only ratio to open_clip_train: its per-step times are not synchronised with
        # the GPU (open_clip_train_row), so its step alone cannot be told from its data wait
        "end_to_end_over_open_clip_train": over(e2e, oc.get("samples_per_s")),
        "end_to_end_over_plain_pytorch": over(e2e, plain),
        "loader_over_end_to_end": over(loader_rate, e2e),
    }


def _best(rows: list) -> float | None:
    rates = [
        r["samples_per_s"]
        for r in rows
        if r.get("samples_per_s") and not r["grad_checkpointing"] and "note" not in r
    ]
    return max(rates) if rates else None


def markdown(data: dict) -> str:
    env = data.get("env", {})
    lines = [
        "# clipforge GPU benchmark" + (" (dry run: CPU, tiny model)" if data["dry_run"] else ""),
        "",
    ]
    if env:
        lines += [
            f"{env.get('device_name', '?')} (datasheet part: {env.get('datasheet_part') or 'none'},"
            f" dense bf16 peak {_tflops(env.get('datasheet_peak_flops'))} TFLOP/s), measured"
            f" matmul {_tflops(env.get('measured_peak_flops'))} TFLOP/s;"
            f" {_gflop(env.get('flops_per_sample'))} GFLOP per training sample. "
            f"torch {env.get('torch')}, torchvision {env.get('torchvision')}, DeepSpeed"
            f" {env.get('deepspeed')}, open_clip {env.get('open_clip')}, Python {env.get('python')};"
            f" {env.get('cpus')} CPUs, /dev/shm {env.get('dev_shm_gb')} GB;"
            f" {env.get('nvidia_smi') or ''}" + (f" {env['error']}" if env.get("error") else ""),
            "",
            "MFU: model FLOPs (forward + backward) over the datasheet's dense bf16 peak of the part;"
            " none where the part is not in the table (CPU included). The second column divides"
            " by the matmul rate measured in this run instead.",
            "",
        ]
    step_header = [
        "| ZeRO | micro | accum | compile | grad ckpt | samples/s | MFU | MFU (measured matmul)"
        " | peak mem GB | note |",
        "|---:|---:|---:|:---:|:---:|---:|---:|---:|---:|---|",
    ]
    for section, title in (
        ("zero1", "ZeRO-1 eager step, in-memory batches"),
        ("zero23", "ZeRO-2 and ZeRO-3, each row in a fresh process"),
        ("compile", "ZeRO-1 with torch.compile, each row in a fresh process"),
    ):
        if section in data:
            lines += [f"## {section}: {title}", "", *step_header]
            lines += [_step_line(r) for r in data[section]]
            lines.append("")
    if "losses" in data:
        lines += [
            "## losses: the ZeRO-1 step with SigLIP's loss and with a teacher",
            "",
            "| step | micro | samples/s | over plain | MFU | peak mem GB | note |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        lines += [
            f"| {r['variant']} | {r['micro']} | {_num(r.get('samples_per_s'))} |"
            f" {_num(r.get('over_plain'), 2)} | {_pct(r.get('mfu'))} |"
            f" {_num(r.get('peak_mem_gb'), 1)} | {r.get('error', r.get('note', ''))} |"
            for r in data["losses"]
        ]
        lines.append("")
    if "reference" in data:
        lines += [
            "## reference: the same model, batches and precision without clipforge",
            "",
            "| reference | samples/s | MFU | note |",
            "|---|---:|---:|---|",
        ]
        for r in data["reference"]:
            lines.append(
                f"| {r.get('name')} | {_num(r.get('samples_per_s'))} | {_pct(r.get('mfu'))} |"
                f" {r.get('error', r.get('note', ''))} |"
            )
        lines.append("")
    if "end_to_end" in data:
        e = data["end_to_end"]
        lines += [
            "## end_to_end: the step fed by the real loader",
            "",
            f"ZeRO-{e.get('zero')}, micro {e.get('micro')}, {e.get('workers')} workers:"
            f" {_num(e.get('samples_per_s'))} samples/s, MFU {_pct(e.get('mfu'))}"
            f" (measured matmul: {_pct(e.get('mfu_measured_peak'))})"
            + (f" {e['error']}" if e.get("error") else ""),
            "",
        ]
    if "loader" in data:
        lines += ["## loader alone, 256 px JPEGs", "", "| decode | workers | images/s | note |"]
        lines.append("|---|---:|---:|---|")
        lines += [
            f"| {r.get('decode')} | {r.get('workers', '-')} | {_num(r.get('images_per_s'))} |"
            f" {r.get('error', '')} |"
            for r in data["loader"]
        ]
        lines.append("")
    if "ratios" in data:
        lines += ["## ratios (targets: step >= 0.9x plain PyTorch, loader >= 1.2x end to end)"]
        lines += ["", *[f"- {k}: {_num(v, 2)}" for k, v in data["ratios"].items()], ""]
    if "train_run" in data:
        lines += ["## train_run: python -m clipforge.train with a resume", ""]
        lines += [f"- {k}: {v}" for k, v in data["train_run"].items()]
        lines.append("")
    return "\n".join(lines)


def _step_line(r: dict) -> str:
    return (
        f"| {r['zero']} | {r['micro']} | {r['accum']} | {'on' if r['compile'] else 'off'} |"
        f" {'on' if r['grad_checkpointing'] else 'off'} | {_num(r.get('samples_per_s'))} |"
        f" {_pct(r.get('mfu'))} | {_pct(r.get('mfu_measured_peak'))} |"
        f" {_num(r.get('peak_mem_gb'), 1)} | {r.get('error', r.get('note', ''))} |"
    )


def _num(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _tflops(value) -> str:
    return "-" if value is None else f"{value / 1e12:.3g}"


def _gflop(value) -> str:
    return "-" if value is None else f"{value / 1e9:.1f}"


# -- env ----------------------------------------------------------------------------------------


def environment(profile: Profile) -> dict:
    import torch

    from clipforge.model.names import register_bundled_configs
    from clipforge.train.flops import datasheet_peak, flops_per_sample

    register_bundled_configs()
    cuda = profile.device == "cuda"
    name = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    part = datasheet_peak(name) if cuda else None
    shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
    return {
        **versions(),
        "device_name": name,
        "cpus": _CPUS,
        "cpu_count": os.cpu_count(),
        "dev_shm_gb": round(shm.total / 1e9, 1) if shm else None,
        "dev_shm_free_gb": round(shm.free / 1e9, 1) if shm else None,
        "nvidia_smi": nvidia_smi(),  # on CPU too: its absence is a fact, and the path runs
        "clipforge_gpu_reads": clipforge_gpu_reads(),
        "flops_per_sample": flops_per_sample(_model_cfg(profile)),
        "datasheet_part": part[0] if part else None,
        "datasheet_peak_flops": part[1] if part else None,
        **_measured_peak(measured_matmul_flops(profile.device, 8192 if cuda else 512)),
    }


def _measured_peak(matmul: dict) -> dict:
    return {
        "measured_peak_flops": matmul["flops"],
        "measured_peak_timing": {k: v for k, v in matmul.items() if k != "flops"},
    }


def versions() -> dict:
    """Each package's version, or why it does not import (DeepSpeed's rows then say so too)."""
    import importlib

    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__}
    found["cuda"] = torch.version.cuda
    for key, module in (
        ("torchvision", "torchvision"),
        ("deepspeed", "deepspeed"),
        ("open_clip", "open_clip"),
        ("numpy", "numpy"),
        ("pillow", "PIL"),
    ):
        try:
            found[key] = importlib.import_module(module).__version__
        except Exception as exc:  # noqa: BLE001 - a broken install is a fact to record
            found[key] = f"does not import: {first_line(exc)}"
    return found


def clipforge_gpu_reads() -> dict:
    """The GPU facts clipforge's own code reads on a GPU host, read by that code: the run's
    alerts' NVML readings (clipforge.alerts.gpu) and the GPUs the host supervisor counts
    (clipforge.launcher.host.gpus); on a CPU each says why there is nothing to read."""
    from clipforge.alerts.gpu import open_nvml
    from clipforge.launcher.host.gpus import read_inventory

    try:
        reader = open_nvml()
        if isinstance(reader, str):
            nvml: object = reader
        else:
            try:
                nvml = [dataclasses.asdict(r) for r in reader.read()]
            finally:
                reader.close()
        with tempfile.TemporaryDirectory() as node_dir:
            inventory = read_inventory(node_dir, planned=1)
    except Exception as exc:  # noqa: BLE001 - a failed read is this row's result
        return {"error": first_line(exc)}
    counted = dataclasses.asdict(inventory) if inventory else "nothing can tell: no nvidia-smi"
    return {"nvml": nvml, "supervisor_inventory": counted}


def nvidia_smi() -> str:
    query = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
    try:
        result = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return first_line(exc)
    return f"nvidia-smi ({query}): {result.stdout.strip() or result.stderr.strip()}"


MATMUL_WARM_SECONDS = 0.5  # clocks up from idle before timing
MATMUL_TIMED_SECONDS = 0.2  # timed over at least this: an 8192^3 bf16 product is ~1.4 ms


def measured_matmul_flops(device: str, size: int) -> dict:
    """The matrix-product rate of this device in the profile's training precision (bf16 on a
    GPU: 8192^3 products; fp32 on CPU), timed here: the MFU table's second column. Products run
    for MATMUL_WARM_SECONDS first (a GPU idles at low clocks), then are timed in rounds that
    double until a round lasts MATMUL_TIMED_SECONDS."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def products(count: int) -> float:
        _sync(device)
        began = time.perf_counter()
        for _ in range(count):
            a @ b
        _sync(device)
        return time.perf_counter() - began

    warm, repeats = 0.0, 1
    while warm < MATMUL_WARM_SECONDS:
        warm += products(repeats)
        repeats *= 2
    seconds = products(repeats)
    while seconds < MATMUL_TIMED_SECONDS:
        repeats *= 2
        seconds = products(repeats)
    return {
        "flops": 2 * size**3 * repeats / seconds,
        "warm_seconds": warm,
        "timed_seconds": seconds,
        "products": repeats,
    }


def _model_cfg(profile: Profile) -> dict:
    import open_clip

    cfg = copy.deepcopy(open_clip.get_model_config(profile.model))
    cfg["vision_cfg"]["image_size"] = profile.image_size
    return cfg


def _with_mfu(row: dict, env: dict) -> dict:
    from clipforge.train.flops import mfu

    rate, flops = row.get("samples_per_s"), env.get("flops_per_sample")
    row["mfu"] = mfu(rate, flops, env.get("datasheet_peak_flops"), 1) if rate else None
    measured = env.get("measured_peak_flops")
    row["mfu_measured_peak"] = mfu(rate, flops, measured, 1) if rate else None
    return row


def child_env() -> dict:
    """This process's environment for a child, less the rendezvous init_distributed set here
    (the child would otherwise try to listen on this process's port)."""
    from clipforge.train.dist import LAUNCHER_VARS

    drop = {*LAUNCHER_VARS, "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *sys.path])
    return env


# -- the data -----------------------------------------------------------------------------------


def _render(index: int) -> tuple[str, bytes, str]:
    """One 256 px JPEG of a generated scene with a caption (clipforge's built-in generator)."""
    import numpy as np

    from clipforge.data import builtin

    rng = np.random.default_rng([7, index])
    scene = builtin.random_scene(rng)
    image = builtin.render(scene, rng, JPEG_SIDE)
    return f"{index:08d}", builtin.encode_jpeg(image, quality=90), builtin.captions(scene)[0]


def make_shards(root: Path, count: int):
    """256 px JPEG shards of `count` generated pairs; their clipforge SplitFiles."""
    from multiprocessing import Pool

    from clipforge.data.shards import write_shards
    from clipforge.train.loader import SplitFiles

    with Pool(min(16, _CPUS)) as pool:
        triples = pool.map(_render, range(count), chunksize=64)
    infos = write_shards(triples, root, "train", SHARD_SAMPLES)
    return SplitFiles([root / i.name for i in infos], [i.count for i in infos])


def _bundle(profile: Profile, loss: str = "clip"):
    from clipforge.model.config import ModelConfig
    from clipforge.model.factory import build_model

    return build_model(ModelConfig(name=profile.model, image_size=profile.image_size), loss)


def _teacher(profile: Profile, name: str, dtype):
    """A frozen teacher as the train stage holds one (random weights: the cost is the same)."""
    from clipforge.model.config import ModelConfig
    from clipforge.model.factory import build_model
    from clipforge.train.teacher import Teacher

    model = build_model(ModelConfig(name=name, image_size=profile.image_size)).model
    return Teacher(model.to(profile.device), dtype)


def _dataset(files, bundle, plan, steps: int):
    from clipforge.train import loader as data

    transform = data.uint8_transform(bundle.preprocess_train)[0]
    return data.MicroBatches(files, plan, 0, 0, steps, transform, bundle.tokenizer, 64)


# -- the step -----------------------------------------------------------------------------------


class Stepper:
    """A DeepSpeed engine of the benchmark's model and the loop's own step (train/loop.py's
    contrastive step, per-step check and temperature clamp), without logging."""

    def __init__(
        self,
        profile: Profile,
        bundle,
        zero: int,
        micro: int,
        compile_model: bool,
        grad_checkpointing: bool = False,
        check: bool = True,
        loss: str = "clip",
        teacher: str | None = None,
    ):
        import torch

        from clipforge.pipeline.params import load_pipeline_params
        from clipforge.train.config import BatchPlan
        from clipforge.train.ds_config import deepspeed_config, uses_autocast
        from clipforge.train.engine import create_engine, forward_autocast
        from clipforge.train.loss import make_loss
        from clipforge.train.optim import WarmupCosine

        precision = "bf16" if profile.device == "cuda" else "fp32"
        train = load_pipeline_params(
            None,
            [
                f"train.global_batch_size={profile.global_batch}",
                f"train.micro_batch_size={micro}",
                f"train.zero_stage={zero}",
                "train.optimizer=torch",  # no JIT-compiled op on a machine that may lack a toolchain
            ],
        ).train
        self.plan = BatchPlan(profile.global_batch, micro, profile.global_batch // micro, 1)
        config = deepspeed_config(train, self.plan, profile.device, precision)
        # SigLIP's loss needs its learned bias, which only a model built for it has
        model = copy.deepcopy(bundle.model) if loss == "clip" else _bundle(profile, loss).model
        model.set_grad_checkpointing(grad_checkpointing)
        backend = profile.compile_backend if compile_model else None
        self.engine = create_engine(
            model, config, WarmupCosine(0, 1000, 0.0), 0.2, compile_model, backend
        )
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # as run.py feeds
        self.autocast = forward_autocast(profile.device, uses_autocast(precision, zero))
        self.loss_fn = make_loss(loss, 0, 1, 1.0 if teacher else None)
        self.teacher = _teacher(profile, teacher, self.dtype) if teacher else None
        self.device = profile.device
        self.previous_norm = None
        self.check = check

    def step(self, micro_batches) -> None:
        from clipforge.train.engine import clamp_logit_scale
        from clipforge.train.loop import agree
        from clipforge.train.loss import contrastive_step

        def skip_if(loss):  # the loop's per-step check, with the previous update's norm
            if not self.check:
                return False
            agreed = agree(loss, self.previous_norm, False, self.device)
            return not agreed.loss == agreed.loss  # NaN

        contrastive_step(
            self.engine, self.loss_fn, micro_batches, skip_if, self.autocast, self.teacher
        )
        clamp_logit_scale(self.engine, 100.0)
        self.previous_norm = self.engine.get_global_grad_norm()


class PlainStepper:
    """Reference (1): the speed of light for this model in eager PyTorch. open_clip's model and
    ClipLoss, fp32 weights under bf16 autocast (on the GPU), fused AdamW, gradient clipping and
    the temperature clamp as clipforge does them; no DeepSpeed, no accumulation."""

    def __init__(self, profile: Profile, bundle):
        import torch

        from clipforge.train.engine import forward_autocast
        from clipforge.train.loss import make_loss
        from clipforge.train.optim import param_groups

        self.device = profile.device
        from clipforge.model.factory import without_causal_flag

        self.model = without_causal_flag(bundle.model).to(profile.device).train()
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, 0.2), lr=5e-4, betas=(0.9, 0.98), eps=1e-6, fused=True
        )
        self.autocast = forward_autocast(profile.device, profile.device == "cuda")
        self.loss_fn = make_loss("clip", 0, 1)
        self.dtype = torch.bfloat16 if profile.device == "cuda" else torch.float32
        self.plan = _plan(profile.global_batch, profile.global_batch)

    def step(self, micro_batches) -> None:
        import math

        import torch

        ((images, texts),) = micro_batches
        with self.autocast():
            out = self.model(image=images, text=texts)
            loss = self.loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.logit_scale.clamp_(max=math.log(100.0))


def _plan(global_batch: int, micro: int):
    from clipforge.train.config import BatchPlan

    return BatchPlan(global_batch, micro, global_batch // micro, 1)


def _synthetic_micro_batches(profile: Profile, stepper, bundle):
    import torch

    generator = torch.Generator(profile.device).manual_seed(0)
    m, context = stepper.plan.micro_batch_size, bundle.model.context_length
    shape = (m, 3, profile.image_size, profile.image_size)
    return [
        (
            torch.randn(shape, device=profile.device, generator=generator).to(stepper.dtype),
            torch.randint(1, 49000, (m, context), device=profile.device, generator=generator),
        )
        for _ in range(stepper.plan.grad_accum_steps)
    ]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(profile: Profile, stepper, next_batches, timed_steps: int) -> dict:
    import torch

    from clipforge.train.reporting import peak_memory_gb

    for _ in range(profile.warmup_steps):
        stepper.step(next_batches())
    _sync(profile.device)
    if profile.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for _ in range(timed_steps):
        stepper.step(next_batches())
    _sync(profile.device)
    seconds = time.perf_counter() - began
    return {
        "samples_per_s": timed_steps * profile.global_batch / seconds,
        "timed_steps": timed_steps,
        "peak_mem_gb": peak_memory_gb(profile.device),
    }


def _free(*objects) -> None:
    import torch

    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def step_row(
    profile: Profile,
    bundle,
    zero: int,
    micro: int,
    compiled: bool,
    ckpt: bool,
    check: bool = True,
    **variant,
) -> dict:
    """A step's rate; `variant`: Stepper's loss or teacher."""
    stepper = Stepper(profile, bundle, zero, micro, compiled, ckpt, check, **variant)
    batches = _synthetic_micro_batches(profile, stepper, bundle)
    try:
        return _timed(profile, stepper, lambda: batches, profile.timed_steps)
    finally:
        _free(stepper, batches)


def _row_key(zero: int, micro: int, compiled: bool, ckpt: bool, global_batch: int) -> dict:
    return {
        "zero": zero,
        "micro": micro,
        "accum": global_batch // micro,
        "compile": compiled,
        "grad_checkpointing": ckpt,
    }


def measure_zero1(profile, bundle, env, report, clock, budget) -> None:
    ends = time.monotonic() + budget
    first = profile.zero1_micro_batches[0]
    configs = [(m, False, True) for m in profile.zero1_micro_batches]
    configs.append((first, True, True))  # gradient checkpointing: its cost
    # The loop reads the loss back before backward (an exact skip of a non-finite step needs
    # it); the same step without that read is what moving it off the critical path could gain.
    configs.append((first, False, False))
    for micro, ckpt, check in configs:
        row = _row_key(1, micro, False, ckpt, profile.global_batch)
        if not check:
            row["note"] = "no loss read before backward (what that wait costs)"
        left = min(ends - time.monotonic(), clock.left())
        row.update(attempt(left, step_row, profile, bundle, 1, micro, False, ckpt, check))
        report.row("zero1", _with_mfu(row, env))


def measure_losses(profile, bundle, env, report, clock, budget) -> None:
    """SigLIP's loss and a teacher against the plain step, at the best ZeRO-1 micro batch: the
    plain step again first, so each ratio compares rows measured minutes apart at most."""
    ends = time.monotonic() + budget
    micro = _best_micro(report, profile)
    variants = ({}, {"loss": "siglip"}, {"teacher": profile.teacher})
    plain = None
    for variant in variants:
        row = {"variant": _variant_name(variant), "micro": micro}
        left = min(ends - time.monotonic(), clock.left())
        measure = functools.partial(step_row, **variant)
        row.update(attempt(left, measure, profile, bundle, 1, micro, False, False))
        rate = _rate(row)
        plain = plain if variant else rate
        row["over_plain"] = rate / plain if rate and plain else None
        if "teacher" in variant:  # MFU counts the student's FLOPs only: the teacher's are extra
            row["note"] = "MFU: the student's FLOPs; the teacher's forward is on top"
        report.row("losses", _with_mfu(row, env))


def _variant_name(variant: dict) -> str:
    if "teacher" in variant:
        return f"CLIP loss, teacher {variant['teacher']} (bf16 on a GPU)"
    return f"{variant.get('loss', 'clip')} loss"


def plain_row(profile: Profile, bundle) -> dict:
    stepper = PlainStepper(profile, bundle)
    batches = _synthetic_micro_batches(profile, stepper, bundle)
    try:
        return {
            "name": "plain_pytorch",
            **_timed(profile, stepper, lambda: batches, 2 * profile.timed_steps),
        }
    finally:
        _free(stepper, batches)


def measure_references(profile, bundle, env, report, clock, budget, work: Path) -> None:
    ends = time.monotonic() + budget
    row = attempt(min(ends - time.monotonic(), clock.left()), plain_row, profile, bundle)
    report.row("reference", _with_mfu({"name": "plain_pytorch", **row}, env))
    row = attempt(
        min(ends - time.monotonic(), clock.left()), open_clip_train_row, profile, work / "oc"
    )
    report.row("reference", _with_mfu({"name": "open_clip_train", **row}, env))


# Reference (2): open_clip_train's own main(), in a process of its own, on its synthetic data.
_OC_LINE = re.compile(r"Batch \(t\): ([0-9.]+),")
# open_clip_train's DataLoader keeps its default prefetch of 2 batches per worker in /dev/shm,
# each of fp32 images (its synthetic data, like its decoded data, is a float tensor).
OC_PREFETCH = 2
SHM_SHARE = 0.8  # of the free /dev/shm its workers may fill


def open_clip_train_workers(profile: Profile, shm_free_bytes: int) -> int:
    """profile.open_clip_workers, fewer where /dev/shm cannot hold their batches (15 workers of
    1024 224-px batches need about 18 GB there; a worker short of it dies with a bus error)."""
    batch_bytes = profile.global_batch * 3 * profile.image_size**2 * 4
    fits = int(SHM_SHARE * shm_free_bytes) // (OC_PREFETCH * batch_bytes)
    return max(0, min(profile.open_clip_workers, fits))


def open_clip_train_argv(profile: Profile, logs: Path, workers: int) -> list[str]:
    argv = [
        "--dataset-type", "synthetic",
        "--train-num-samples", str(profile.open_clip_steps * profile.global_batch),
        "--batch-size", str(profile.global_batch),
        "--model", profile.model,
        "--force-image-size", str(profile.image_size),
        "--precision", "amp_bf16" if profile.device == "cuda" else "fp32",
        "--workers", str(workers),
        "--epochs", "1",
        "--lr", "5e-4", "--wd", "0.2", "--warmup", "1", "--grad-clip-norm", "1.0",
        "--local-loss", "--gather-with-grad",
        "--log-every-n-steps", "1",  # one line per step; each reads the loss (a host sync)
        "--save-frequency", "0",
        "--logs", str(logs), "--name", "bench",
        "--seed", "0",
    ]  # fmt: skip
    return argv


def open_clip_train_row(profile: Profile, logs: Path) -> dict:
    """samples/s of open_clip_train's loop end to end: its per-step `Batch (t)` over the steps
    after warm-up. Only end to end: its loop (open_clip_train 3.3, train.py) takes the step's end
    time before the `loss.item()` of its log line, the one host sync, so each step's GPU work
    drains into the next step's `Data (t)`; summed over steps `Batch (t)` is the wall clock,
    while `Batch (t) - Data (t)` would overstate its step alone."""
    shm_free = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else 0
    workers = open_clip_train_workers(profile, shm_free)
    command = [sys.executable, str(Path(__file__).resolve()), "--open-clip-train", "--"]
    command += open_clip_train_argv(profile, logs, workers)
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=3600)
    log = logs / "bench" / "out.log"
    text = log.read_text() if log.is_file() else ""
    times = [float(b) for b in _OC_LINE.findall(text)][profile.warmup_steps :]
    if result.returncode or not times:
        raise RuntimeError(f"open_clip_train exited {result.returncode}: {_last_error(result)}")
    return {
        "samples_per_s": profile.global_batch / (sum(times) / len(times)),
        "timed_steps": len(times),
        "workers": workers,
        "note": f"{workers} workers (/dev/shm {shm_free / 1e9:.1f} GB free), synthetic data;"
        " end to end only (its step times are not synchronised with the GPU)",
    }


def _last_error(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in (result.stderr or "").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^\w+(\.\w+)*(Error|Exception)\b", line)]
    return (errors or lines or ["no output"])[-1][:300]


def run_open_clip_train(argv: list[str]) -> int:
    """The child of open_clip_train_row: clipforge's bundled configs registered, then its main."""
    from clipforge.model.names import register_bundled_configs

    register_bundled_configs()
    from open_clip_train.main import main as open_clip_main

    open_clip_main(argv)
    return 0


# -- end to end and the loader ------------------------------------------------------------------


def end_to_end(profile: Profile, files, bundle, micro: int) -> dict:
    from clipforge.train import loader as data

    stepper = Stepper(profile, bundle, 1, micro, False)
    plan = stepper.plan
    steps = profile.warmup_steps + profile.end_to_end_steps
    dataset = _dataset(files, bundle, plan, steps)
    _, mean, std = data.uint8_transform(bundle.preprocess_train)
    to_device = data.DeviceBatches(mean, std, _torch_device(profile.device), stepper.dtype)
    loader = data.micro_batch_loader(
        dataset, 0, profile.end_to_end_workers, profile.device == "cuda", PREFETCH
    )
    try:
        result = _timed(
            profile,
            stepper,
            lambda: [to_device(next(loader)) for _ in range(plan.grad_accum_steps)],
            profile.end_to_end_steps,
        )
    finally:
        _free(stepper)
    in_flight = profile.end_to_end_workers * PREFETCH
    timed_chunks = profile.end_to_end_steps * plan.grad_accum_steps * dataset.chunks_per_micro_batch
    return {
        "zero": 1,
        "micro": micro,
        "workers": profile.end_to_end_workers,
        **result,
        "timed_chunks_over_in_flight": timed_chunks / max(1, in_flight),
    }


def loader_row(profile: Profile, files, bundle, workers: int) -> dict:
    """images/s of the loader alone (train/loader.py's micro_batch_loader): timed over at least
    max(loader_min_chunks, 4 x what can be in flight) chunks, after as many as can be in flight
    were taken (the workers started, their queue full)."""
    from clipforge.train import loader as data

    micro = 256 if profile.device == "cuda" else 32
    per_micro = len(data.chunk_bounds(micro))
    in_flight = -(-max(1, workers) * PREFETCH // per_micro)  # in micro-batches
    timed = -(-max(profile.loader_min_chunks, 4 * max(1, workers) * PREFETCH) // per_micro)
    dataset = _dataset(files, bundle, _plan(micro, micro), in_flight + timed + 1)
    loader = data.micro_batch_loader(dataset, 0, workers, profile.device == "cuda", PREFETCH)
    for _ in range(in_flight):
        next(loader)
    began = time.perf_counter()
    images = sum(sum(c[0].shape[0] for c in next(loader)) for _ in range(timed))
    rate = images / (time.perf_counter() - began)
    del loader
    return {"images_per_s": rate, "timed_chunks": timed * per_micro}


def device_decode_row(profile: Profile, files, batch: int = 256, repeats: int = 8) -> dict:
    """Batched decode_jpeg on the device (nvjpeg on a GPU) plus the crop and resize to the
    model's input there: the loader's option of decoding on the device."""
    import torch

    from clipforge.data.shards import ShardReader
    from clipforge.train.loader import decode_resize_on_device

    reader = ShardReader(files.paths)
    encoded = [
        torch.frombuffer(bytearray(reader.read(0, i)["jpg"]), dtype=torch.uint8)
        for i in range(min(batch, files.counts[0]))
    ]
    device = _torch_device(profile.device)
    decode_resize_on_device(encoded, profile.image_size, device)
    _sync(profile.device)
    began = time.perf_counter()
    for _ in range(repeats):
        decode_resize_on_device(encoded, profile.image_size, device)
    _sync(profile.device)
    return {
        "decode": f"decode_jpeg on {profile.device}, batched",
        "images_per_s": repeats * len(encoded) / (time.perf_counter() - began),
    }


def measure_loader(profile, files, bundle, report, clock, budget) -> None:
    ends = time.monotonic() + budget
    for workers in profile.worker_counts:
        row = attempt(min(ends - time.monotonic(), clock.left()), loader_row, profile, files,
                      bundle, workers)  # fmt: skip
        report.row("loader", {"decode": "cpu workers", "workers": workers, **row})
    row = attempt(min(ends - time.monotonic(), clock.left()), device_decode_row, profile, files)
    report.row("loader", {"decode": f"decode_jpeg on {profile.device}", **row})


def _torch_device(device: str):
    import torch

    return torch.device(device, 0) if device == "cuda" else torch.device("cpu")


# -- rows in a fresh process --------------------------------------------------------------------


def fresh_process_row(profile: Profile, dry_run: bool, key: dict, seconds: float) -> dict:
    """One step row measured by a child process of this script (`--row`)."""
    if seconds <= 0:
        raise OutOfTime("no time left")
    command = [sys.executable, str(Path(__file__).resolve()), "--row", json.dumps(key)]
    command += ["--dry-run"] if dry_run else []
    try:
        result = subprocess.run(
            command, env=child_env(), capture_output=True, text=True, timeout=seconds
        )
    except subprocess.TimeoutExpired:
        raise OutOfTime(f"over its {seconds:.0f} s budget") from None
    sys.stderr.write(result.stderr[-4000:])
    rows = [line[4:] for line in result.stdout.splitlines() if line.startswith("ROW ")]
    if not rows:
        raise RuntimeError(f"the row's process exited {result.returncode}: {_last_error(result)}")
    return json.loads(rows[-1])


def child_row(profile: Profile, key: dict) -> int:
    from clipforge.train.dist import init_distributed

    try:
        init_distributed(profile.device)
        bundle = _bundle(profile)
        args = (key["zero"], key["micro"], key["compile"], key["grad_checkpointing"])
        row = step_row(profile, bundle, *args)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as the row's error
        traceback.print_exc()
        row = {"error": first_line(exc)}
    print("ROW " + json.dumps(row), flush=True)
    return 0


def measure_fresh(profile, dry_run, env, report, clock, budget, section, configs) -> None:
    ends = time.monotonic() + budget
    for zero, micro, compiled in configs:
        key = _row_key(zero, micro, compiled, False, profile.global_batch)
        left = min(ends - time.monotonic(), clock.left())
        row = attempt(left + 5, fresh_process_row, profile, dry_run, key, left)
        report.row(section, _with_mfu({**key, **row}, env))


# -- the real stage -----------------------------------------------------------------------------


def real_run(profile: Profile, workdir: Path) -> dict:
    """data stage -> train stage stopped by SIGTERM after a held step -> rerun resumes -> done."""
    env = child_env()
    sets = [
        f"model.name={profile.model}",
        f"model.image_size={profile.image_size}",
        f"data.num_train={profile.run_images}",
        "data.num_val=64",
        "data.num_test_images=20",
        f"data.image_size={JPEG_SIDE if profile.device == 'cuda' else 64}",
        f"train.device={profile.device}",
        f"train.global_batch_size={profile.run_batch}",
        f"train.max_steps={profile.run_steps}",
        "train.warmup_steps=2",
        f"train.save_every_steps={profile.run_save_every}",
        "train.log_every_steps=2",
        "train.optimizer=torch",
        f"train.precision={profile.run_precision}",
        f"train.num_workers={min(8, _CPUS) if profile.device == 'cuda' else 0}",
    ]
    args = ["--params", str(REPO / "params.yaml"), *sum((["--set", s] for s in sets), [])]
    subprocess.run(
        [sys.executable, "-m", "clipforge.data", *args],
        cwd=workdir,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    train = [sys.executable, "-m", "clipforge.train", *args]
    held = subprocess.Popen(
        train,
        cwd=workdir,
        env={**env, "CLIPFORGE_FAULTS": f"hold@{profile.run_hold_step}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    tsv = workdir / "metrics" / "train.tsv"
    try:
        # the held step waits for a stop request: send it once the run has logged the step before
        while not (tsv.is_file() and _steps(tsv) and _steps(tsv)[-1] >= profile.run_hold_step - 2):
            if held.poll() is not None:
                raise RuntimeError(f"the first run ended early: {held.stderr.read()[-2000:]}")
            time.sleep(0.5)
        held.send_signal(signal.SIGTERM)
        stopped_code = held.wait()
    finally:
        if held.poll() is None:
            held.kill()
            held.wait()
    began = time.perf_counter()
    resumed = subprocess.run(train, cwd=workdir, env=env, capture_output=True, text=True)
    if resumed.returncode:
        raise RuntimeError(f"the resumed run failed: {_last_error(resumed)}")
    summary = json.loads((workdir / "metrics" / "train.info.json").read_text())
    losses = _losses(tsv)
    ran_as = _RUN_AS.search(resumed.stderr)
    return {
        "precision": ran_as.group(1) if ran_as else None,  # as resolved (auto: bf16 on a GPU)
        "zero_stage": int(ran_as.group(2)) if ran_as else None,
        # on a GPU the micro batch is probed at the run's first start (train.micro_batch_size:
        # auto), and kept in the run directory for its resumes
        "batch_plan": _batch_plan(workdir / "checkpoints"),
        "stopped_exit_code": stopped_code,
        "resumed_from_step": summary["resumed_from_step"],
        "steps": summary["steps"],
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "loss_falls": losses[-1] < losses[0],
        "resumed_run_seconds": round(time.perf_counter() - began, 1),
        "samples_per_s": summary.get("samples_per_s"),
        "mfu": summary.get("mfu"),
        "export_loads_in_open_clip": export_loads(workdir / "models" / "clip"),
    }


# the train stage's start line: "... batch B = M micro x A accum x R ranks, cuda bf16 ZeRO-1"
_RUN_AS = re.compile(r" (bf16|fp32) ZeRO-(\d)\b")


def _batch_plan(checkpoints: Path) -> dict | None:
    from clipforge.train.microbatch import PLAN_FILE

    found = sorted(checkpoints.glob(f"run-*/{PLAN_FILE}"))
    return json.loads(found[0].read_text()) if found else None


def _steps(tsv: Path) -> list[int]:
    return [int(line.split("\t")[0]) for line in tsv.read_text().splitlines()[1:] if line]


def _losses(tsv: Path) -> list[float]:
    return [float(line.split("\t")[2]) for line in tsv.read_text().splitlines()[1:] if line]


def export_loads(model_dir: Path) -> bool:
    """Plain open_clip, no clipforge: load the export, embed an image and a caption."""
    import open_clip
    import torch
    from PIL import Image

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{model_dir}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{model_dir}")
    image = preprocess(Image.new("RGB", (300, 200), "red"))[None]
    with torch.no_grad():
        out = model(image, tokenizer(["红色的圆"]))
    return bool(torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all())


# -- main ---------------------------------------------------------------------------------------


def run_all(profile: Profile, dry_run: bool, out: Path, skip: set[str]) -> None:
    clock = Clock(profile.total_seconds)
    report = Report(out, profile, dry_run)

    def budget(section: str) -> float:
        return min(profile.section_seconds[section], clock.left())

    env = attempt(budget("env"), environment, profile)
    report.add("env", env)
    # Each guarded: without DeepSpeed (or its process group) the rows that need none still run.
    deepspeed = attempt(min(profile.setup_seconds, clock.left()), _deepspeed_ready, profile)
    bundle = attempt(min(profile.setup_seconds, clock.left()), _bundle, profile)
    broken = {
        "deepspeed": {"error": f"DeepSpeed: {deepspeed['error']}"}
        if "error" in deepspeed
        else None,
        "model": {"error": f"the model: {bundle['error']}"} if isinstance(bundle, dict) else None,
    }

    def cannot_run(section: str) -> dict | None:
        """Why `section` cannot run at all (its rows say so), or None."""
        needs = ["model"] * (section != "train_run")
        needs += ["deepspeed"] * (section in DEEPSPEED_SECTIONS)
        return next((broken[n] for n in needs if broken[n]), None)

    with tempfile.TemporaryDirectory(prefix="clipforge-gpu-bench-") as tmp:
        work = Path(tmp)
        if "zero1" not in skip:
            if why := cannot_run("zero1"):
                report.row("zero1", {**_row_key(1, profile.zero1_micro_batches[0], False, False,
                                                profile.global_batch), **why})  # fmt: skip
            else:
                measure_zero1(profile, bundle, env, report, clock, budget("zero1"))
        if "losses" not in skip:
            if why := cannot_run("losses"):
                report.row("losses", {"variant": "-", "micro": "-", **why})
            else:
                measure_losses(profile, bundle, env, report, clock, budget("losses"))
        if "reference" not in skip:
            if why := cannot_run("reference"):
                report.row("reference", {"name": "plain_pytorch", **why})
            else:
                measure_references(profile, bundle, env, report, clock, budget("reference"), work)
        # the shards both need, made within end_to_end's cap
        began, files = time.monotonic(), None
        if {"end_to_end", "loader"} - skip and not cannot_run("loader"):
            shards_cap = budget("end_to_end") if "end_to_end" not in skip else 60
            files = attempt(shards_cap, make_shards, work / "shards", profile.num_images)
        no_shards = {"error": f"no shards: {files['error']}"} if isinstance(files, dict) else None
        if "end_to_end" not in skip:
            row = cannot_run("end_to_end") or no_shards
            if row is None:
                left = budget("end_to_end") - (time.monotonic() - began)
                row = attempt(
                    left, end_to_end, profile, files, bundle, _best_micro(report, profile)
                )
            report.add("end_to_end", _with_mfu(row, env))
        for section, configs in (
            ("zero23", [(2, profile.zero23_micro_batch, False), (3, profile.zero23_micro_batch, False)]),
            ("compile", [(1, profile.compile_micro_batch, True)]),
        ):  # fmt: skip
            if section in skip:
                continue
            if why := cannot_run(section):
                for zero, micro, compiled in configs:
                    key = _row_key(zero, micro, compiled, False, profile.global_batch)
                    report.row(section, {**key, **why})
                continue
            measure_fresh(profile, dry_run, env, report, clock, budget(section), section, configs)
        if "loader" not in skip:
            if why := cannot_run("loader") or no_shards:
                report.row("loader", {"decode": "-", **why})
            else:
                measure_loader(profile, files, bundle, report, clock, budget("loader"))
        _free(bundle)
        if "train_run" not in skip:
            left = clock.left()
            if why := cannot_run("train_run"):
                result = why
            elif left < profile.train_run_min_seconds:
                result = {"error": f"not started: {left:.0f} s left of the run's budget"}
            else:
                (work / "run").mkdir()
                result = attempt(left, real_run, profile, work / "run")
            report.add("train_run", result)


def _deepspeed_ready(profile: Profile) -> dict:
    """DeepSpeed imported and its process group up (a world of one), as the train stage sets it."""
    from clipforge.train.dist import init_distributed

    init_distributed(profile.device)
    return {}


def _best_micro(report: Report, profile: Profile) -> int:
    """The micro batch of the fastest ZeRO-1 row (plain, checked), the smallest when none ran."""
    rows = [r for r in report.data.get("zero1", []) if not r["grad_checkpointing"]]
    ok = [r for r in rows if r.get("samples_per_s") and "note" not in r]
    return max(ok, key=_rate)["micro"] if ok else profile.zero1_micro_batches[-1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--open-clip-train"]:
        return run_open_clip_train(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder for gpu-bench.json/.md")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, a few minutes")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=[s for s in SECTIONS if s != "env"]
    )
    parser.add_argument(
        "--total-seconds",
        type=float,
        help="start no row after this many seconds (default: the profile's, 430 on a GPU)",
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a child measuring one step row
    args = parser.parse_args(argv)
    profile = DRY if args.dry_run else FULL
    if args.total_seconds:
        profile = dataclasses.replace(profile, total_seconds=args.total_seconds)
    if profile.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.row:
        return child_row(profile, json.loads(args.row))
    if args.out is None:
        parser.error("--out is required")
    run_all(profile, args.dry_run, args.out, set(args.skip))
    print((args.out / "gpu-bench.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
