"""The train stage on a GPU: loader, step, end to end, and a real run with resume.

    bench/gpu-run.sh OUT_DIR             # on a GPU machine (installs missing wheels first)
    python bench/gpu.py --out DIR --dry-run   # the same code on CPU with a tiny model (make test)

Writes DIR/gpu-bench.json and DIR/gpu-bench.md after every section, so a run cut short by its
time limit still leaves what it measured:
  (a) the loader alone over 256 px JPEG shards it generates: images/s by worker count; and
      batched JPEG decoding on the GPU (torchvision.io.decode_jpeg) against the CPU workers;
  (b) the ViT-B/32 bf16 train step on in-memory batches: ZeRO 1/2/3 x micro batch x
      torch.compile, in samples/s, MFU and peak memory (global batch fixed: smaller micro
      batches accumulate with feature caching, whose extra forward is overhead, not MFU);
  (c) end to end: the same step fed by the real loader;
  (d) `python -m clipforge.train` for real: stopped with SIGTERM mid-run, resumed, finished;
      the loss falls and the exported model loads in plain open_clip.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


@dataclass(frozen=True)
class Profile:
    device: str
    model: str
    image_size: int
    num_images: int
    worker_counts: tuple[int, ...]
    loader_images: int  # images read per loader measurement
    global_batch: int
    micro_batches: tuple[int, ...]
    compile_micro_batches: tuple[int, ...]  # ZeRO-1 configs also measured with torch.compile
    warmup_steps: int
    timed_steps: int
    end_to_end_workers: int
    run_steps: int  # (d): steps of the real run; it is stopped after `run_hold_step`
    run_hold_step: int
    run_save_every: int
    run_batch: int
    run_images: int


FULL = Profile(
    device="cuda",
    model="ViT-B-32",
    image_size=224,
    num_images=12_288,
    worker_counts=(2, 8, 15),
    loader_images=2048,
    global_batch=1024,
    micro_batches=(256, 512, 1024),
    compile_micro_batches=(1024,),
    warmup_steps=3,
    timed_steps=6,
    end_to_end_workers=15,
    run_steps=30,
    run_hold_step=18,
    run_save_every=10,  # a ViT-B/32 checkpoint is about 2 GB
    run_batch=256,
    run_images=6000,
)
DRY = Profile(
    device="cpu",
    model="clipforge-tiny",
    image_size=64,
    num_images=96,
    worker_counts=(0, 1),
    loader_images=32,
    global_batch=16,
    micro_batches=(8, 16),
    compile_micro_batches=(),
    warmup_steps=1,
    timed_steps=2,
    end_to_end_workers=1,
    run_steps=8,
    run_hold_step=5,
    run_save_every=4,
    run_batch=16,
    run_images=160,
)
SHARD_SAMPLES = 1024
JPEG_SIDE = 256  # LAION as img2dataset resizes it: the loader's real input


class Report:
    """The results so far, rewritten as JSON and markdown after every section."""

    def __init__(self, out: Path, profile: Profile, dry_run: bool):
        self.out = out
        self.data: dict = {"profile": profile.__dict__, "dry_run": dry_run}

    def add(self, section: str, value) -> None:
        self.data[section] = value
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu-bench.json").write_text(json.dumps(self.data, indent=2) + "\n")
        (self.out / "gpu-bench.md").write_text(markdown(self.data))
        print(f"[bench] {section}: {json.dumps(value)[:400]}", flush=True)


def markdown(data: dict) -> str:
    env = data.get("env", {})
    lines = [
        "# clipforge GPU benchmark" + (" (dry run: CPU, tiny model)" if data["dry_run"] else ""),
        "",
        f"{env.get('device_name', '?')}, torch {env.get('torch')}, DeepSpeed {env.get('deepspeed')},"
        f" measured matmul peak {_tflops(env.get('measured_peak_flops'))} TFLOP/s,"
        f" table peak {_tflops(env.get('table_peak_flops'))} TFLOP/s,"
        f" {_gflop(env.get('flops_per_sample'))} GFLOP per training sample",
        "",
    ]
    if "loader" in data:
        lines += ["## (a) loader alone, 256 px JPEGs", "", "| workers | images/s |", "|---:|---:|"]
        lines += [f"| {w} | {r:.0f} |" for w, r in data["loader"]["images_per_s"].items()]
        gpu = data["loader"].get("gpu_decode_images_per_s")
        lines += [
            "",
            f"GPU decode_jpeg (batched, + resize): {gpu if gpu is None else round(gpu)} images/s",
            "",
        ]
    if "step" in data:
        lines += [
            "## (b) train step, in-memory batches",
            "",
            "| ZeRO | micro | accum | compile | grad ckpt | samples/s | MFU (table) | MFU (measured peak) | peak mem GB |",
            "|---:|---:|---:|:---:|:---:|---:|---:|---:|---:|",
        ]
        for r in data["step"]:
            lines.append(
                f"| {r['zero']} | {r['micro']} | {r['accum']} | {'on' if r['compile'] else 'off'} |"
                f" {'on' if r['grad_checkpointing'] else 'off'} |"
                f" {_num(r.get('samples_per_s'))} | {_pct(r.get('mfu'))} |"
                f" {_pct(r.get('mfu_measured_peak'))} | {_num(r.get('peak_mem_gb'), 1)} |"
                + (f" {r['error']}" if r.get("error") else "")
            )
        lines.append("")
    if "end_to_end" in data:
        e = data["end_to_end"]
        lines += [
            "## (c) end to end with the loader",
            "",
            f"ZeRO-{e['zero']}, micro {e['micro']}, {e['workers']} workers: "
            f"{_num(e['samples_per_s'])} samples/s, MFU {_pct(e['mfu'])}; the loader alone at "
            f"that worker count reads {_num(e['loader_images_per_s'])} images/s = "
            f"{_num(e['loader_over_step'], 2)}x the step's samples/s (target >= 1.2)",
            "",
        ]
    if "train_run" in data:
        t = data["train_run"]
        lines += ["## (d) python -m clipforge.train with a resume", ""]
        lines += [f"- {k}: {v}" for k, v in t.items()]
        lines.append("")
    return "\n".join(lines)


def _num(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _tflops(value) -> str:
    return "-" if value is None else f"{value / 1e12:.3g}"


def _gflop(value) -> str:
    return "-" if value is None else f"{value / 1e9:.1f}"


# -- set-up ------------------------------------------------------------------------------------


def environment(profile: Profile) -> dict:
    import deepspeed
    import open_clip
    import torch

    from clipforge.model import register_bundled_configs
    from clipforge.train.flops import flops_per_sample, measured_cpu_flops, peak_flops

    register_bundled_configs()
    cuda = profile.device == "cuda"
    return {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "open_clip": open_clip.__version__,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "cpu_count": os.cpu_count(),
        "flops_per_sample": flops_per_sample(_model_cfg(profile)),
        "table_peak_flops": peak_flops("cuda", "bf16") if cuda else None,
        "measured_peak_flops": measured_bf16_flops() if cuda else measured_cpu_flops(),
    }


def measured_bf16_flops(size: int = 8192, repeats: int = 10) -> float:
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1e3)


def _model_cfg(profile: Profile) -> dict:
    import open_clip

    cfg = copy.deepcopy(open_clip.get_model_config(profile.model))
    cfg["vision_cfg"]["image_size"] = profile.image_size
    return cfg


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
    from clipforge.train.data import SplitFiles

    with Pool(min(16, os.cpu_count() or 1)) as pool:
        triples = pool.map(_render, range(count), chunksize=64)
    infos = write_shards(triples, root, "train", SHARD_SAMPLES)
    return SplitFiles([root / i.name for i in infos], [i.count for i in infos])


def _bundle(profile: Profile):
    from clipforge.config import ModelConfig
    from clipforge.model import build_model

    return build_model(ModelConfig(name=profile.model, image_size=profile.image_size))


def _dataset(files, bundle, plan, steps: int):
    from clipforge.train import data

    transform = data.uint8_transform(bundle.preprocess_train)[0]
    return data.MicroBatches(files, plan, 0, 0, steps, transform, bundle.tokenizer, 64)


# -- (a) the loader ---------------------------------------------------------------------------


def measure_loader(profile: Profile, files, bundle) -> dict:
    from clipforge.config import BatchPlan
    from clipforge.train import data

    micro = min(256, profile.loader_images)
    plan = BatchPlan(micro, micro, 1, 1)
    steps = profile.loader_images // micro
    rates = {}
    for workers in profile.worker_counts:
        loader = data.micro_batch_loader(
            _dataset(files, bundle, plan, steps + 1), 0, workers, False, 4
        )
        next(loader)  # workers started and warm
        began = time.perf_counter()
        images = sum(sum(c[0].shape[0] for c in next(loader)) for _ in range(steps))
        rates[str(workers)] = images / (time.perf_counter() - began)
        del loader
    return {"images_per_s": rates, "gpu_decode_images_per_s": gpu_decode_rate(profile, files)}


def gpu_decode_rate(profile: Profile, files, batch: int = 256, repeats: int = 5) -> float | None:
    """Batched nvjpeg decoding plus a resize to the model's input, on the GPU."""
    if profile.device != "cuda":
        return None
    import torch
    import torchvision
    from torchvision.io import decode_jpeg

    from clipforge.data.shards import ShardReader

    reader = ShardReader(files.paths)
    encoded = [
        torch.frombuffer(bytearray(reader.read(0, i)["jpg"]), dtype=torch.uint8)
        for i in range(min(batch, files.counts[0]))
    ]
    size = [profile.image_size, profile.image_size]

    def once():
        decoded = decode_jpeg(encoded, device="cuda")
        return torch.stack([torchvision.transforms.v2.functional.resize(d, size) for d in decoded])

    once()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        once()
    torch.cuda.synchronize()
    return repeats * len(encoded) / (time.perf_counter() - began)


# -- (b) and (c): the step --------------------------------------------------------------------


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
    ):
        import torch

        from clipforge.config import BatchPlan, load_config
        from clipforge.train.ds_config import deepspeed_bf16, deepspeed_config, uses_autocast
        from clipforge.train.engine import create_engine, forward_autocast
        from clipforge.train.loss import make_clip_loss
        from clipforge.train.optim import WarmupCosine

        precision = "bf16" if profile.device == "cuda" else "fp32"
        train = load_config(
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
        model = copy.deepcopy(bundle.model)
        model.set_grad_checkpointing(grad_checkpointing)
        self.engine = create_engine(model, config, WarmupCosine(0, 1000, 0.0), 0.2, compile_model)
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.ds_bf16 = deepspeed_bf16(precision, zero)
        self.autocast = forward_autocast(profile.device, uses_autocast(precision, zero))
        self.loss_fn = make_clip_loss(0, 1)
        self.device = profile.device

    def step(self, micro_batches) -> None:
        from clipforge.train.engine import clamp_logit_scale
        from clipforge.train.loop import agree
        from clipforge.train.loss import contrastive_step

        def skip_if(loss):
            agreed = agree(loss, None, False, self.device)
            return not agreed.loss == agreed.loss  # NaN

        contrastive_step(self.engine, self.loss_fn, micro_batches, skip_if, self.autocast)
        clamp_logit_scale(self.engine, 100.0)


def _synthetic_micro_batches(profile: Profile, stepper: Stepper, bundle):
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


def _timed(profile: Profile, stepper: Stepper, next_batches) -> dict:
    import torch

    from clipforge.train.reporting import peak_memory_gb

    for _ in range(profile.warmup_steps):
        stepper.step(next_batches())
    if profile.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for _ in range(profile.timed_steps):
        stepper.step(next_batches())
    if profile.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    return {
        "samples_per_s": profile.timed_steps * profile.global_batch / seconds,
        "peak_mem_gb": peak_memory_gb(profile.device),
    }


def _with_mfu(result: dict, env: dict) -> dict:
    from clipforge.train.flops import mfu

    rate, flops = result.get("samples_per_s"), env["flops_per_sample"]
    result["mfu"] = mfu(rate, flops, env["table_peak_flops"], 1) if rate else None
    result["mfu_measured_peak"] = mfu(rate, flops, env["measured_peak_flops"], 1) if rate else None
    return result


def _free(stepper) -> None:
    import torch

    del stepper
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_steps(profile: Profile, bundle, env: dict, report: Report) -> list[dict]:
    """ZeRO 1 (+ compile, + gradient checkpointing), then 2, then 3: ZeRO-3 patches torch's
    linear for the whole process."""
    largest = max(profile.micro_batches)
    configs = [(1, m, False, False) for m in profile.micro_batches]
    configs += [(1, m, True, False) for m in profile.compile_micro_batches]
    configs += [(1, largest, False, True)]  # gradient checkpointing: its cost in speed
    configs += [(z, m, False, False) for z in (2, 3) for m in profile.micro_batches]
    results = []
    for zero, micro, compiled, checkpointing in configs:
        row = {
            "zero": zero,
            "micro": micro,
            "accum": profile.global_batch // micro,
            "compile": compiled,
            "grad_checkpointing": checkpointing,
        }
        try:
            stepper = Stepper(profile, bundle, zero, micro, compiled, checkpointing)
            batches = _synthetic_micro_batches(profile, stepper, bundle)
            row.update(_timed(profile, stepper, lambda batches=batches: batches))
            _free(stepper)
        except Exception as exc:  # noqa: BLE001 - an OOM or a compile failure is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(_with_mfu(row, env))
        report.add("step", results)
    return results


def measure_end_to_end(profile: Profile, files, bundle, env: dict, steps: list[dict]) -> dict:
    from clipforge.config import BatchPlan
    from clipforge.train import data

    ok = [
        r
        for r in steps
        if r["zero"] == 1
        and not (r["compile"] or r["grad_checkpointing"])
        and r.get("samples_per_s")
    ]
    best = max(ok, key=lambda r: r["samples_per_s"])
    stepper = Stepper(profile, bundle, 1, best["micro"], False)
    total_steps = profile.warmup_steps + profile.timed_steps
    plan = BatchPlan(profile.global_batch, best["micro"], best["accum"], 1)
    dataset = _dataset(files, bundle, plan, total_steps)
    transform_mean_std = data.uint8_transform(bundle.preprocess_train)
    to_device = data.DeviceBatches(
        *transform_mean_std[1:], _torch_device(profile.device), stepper.dtype
    )
    loader = data.micro_batch_loader(
        dataset, 0, profile.end_to_end_workers, profile.device == "cuda", 4
    )
    result = _timed(
        profile, stepper, lambda: [to_device(next(loader)) for _ in range(plan.grad_accum_steps)]
    )
    _free(stepper)
    workers = str(profile.end_to_end_workers)
    loader_rate = measure_loader_rate(profile, files, bundle, profile.end_to_end_workers)
    return _with_mfu(
        {
            "zero": 1,
            "micro": best["micro"],
            "workers": int(workers),
            **result,
            "loader_images_per_s": loader_rate,
            "loader_over_step": loader_rate / result["samples_per_s"],
        },
        env,
    )


def measure_loader_rate(profile: Profile, files, bundle, workers: int) -> float:
    return measure_loader(
        Profile(**{**profile.__dict__, "worker_counts": (workers,)}), files, bundle
    )["images_per_s"][str(workers)]


def _torch_device(device: str):
    import torch

    return torch.device(device, 0) if device == "cuda" else torch.device("cpu")


# -- (d) the real stage -----------------------------------------------------------------------


def real_run(profile: Profile, workdir: Path) -> dict:
    """data stage -> train stage stopped by SIGTERM after a held step -> rerun resumes -> done."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    }
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
        f"train.num_workers={min(8, os.cpu_count() or 1) if profile.device == 'cuda' else 0}",
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
    deadline = time.monotonic() + 300
    # the held step waits for a stop request: send it once the run has logged the step before
    while not (tsv.is_file() and _steps(tsv) and _steps(tsv)[-1] >= profile.run_hold_step - 2):
        if held.poll() is not None or time.monotonic() > deadline:
            held.kill()
            raise RuntimeError(f"the first run ended early: {held.stderr.read()[-2000:]}")
        time.sleep(0.5)
    held.send_signal(signal.SIGTERM)
    stopped_code = held.wait(timeout=300)
    began = time.perf_counter()
    resumed = subprocess.run(train, cwd=workdir, env=env, capture_output=True, text=True)
    if resumed.returncode:
        raise RuntimeError(f"the resumed run failed: {resumed.stderr[-2000:]}")
    summary = json.loads((workdir / "metrics" / "train.info.json").read_text())
    losses = _losses(tsv)
    return {
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


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu-bench.json/.md")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, seconds")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["loader", "step", "end_to_end", "train_run"]
    )
    args = parser.parse_args(argv)
    profile = DRY if args.dry_run else FULL
    if profile.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import tempfile

    from clipforge.train.dist import init_distributed

    report = Report(args.out, profile, args.dry_run)
    with tempfile.TemporaryDirectory(prefix="clipforge-gpu-bench-") as tmp:
        work = Path(tmp)
        if "train_run" not in args.skip:  # first: its subprocesses need the GPU to themselves
            (work / "run").mkdir()
            report.add("train_run", real_run(profile, work / "run"))
        init_distributed(profile.device)
        env = environment(profile)
        report.add("env", env)
        files = make_shards(work / "shards", profile.num_images)
        bundle = _bundle(profile)
        if "loader" not in args.skip:
            report.add("loader", measure_loader(profile, files, bundle))
        steps = measure_steps(profile, bundle, env, report) if "step" not in args.skip else []
        if "end_to_end" not in args.skip and any(r.get("samples_per_s") for r in steps):
            report.add("end_to_end", measure_end_to_end(profile, files, bundle, env, steps))
    print((args.out / "gpu-bench.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
