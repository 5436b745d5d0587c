"""The environment record: the code, params, data and stack that produced a result, in one record.

Every result file carries it (train.info.json, eval.info.json, run.json, the model card), under
the key `environment`, so that a number can name how to get it again: the commit and whether the
tree was dirty (with the diff's hash), the resolved params' hash, the data manifest's sha256, the
runtime (host, or image with its digest), the versions of the stack, the hardware, the OS, and the
run's seeds and batch plan. `gather` is its one writer, `from_dict` its one reader.

Cheap: the versions come from importlib.metadata (one walk of the installed distributions, no
subprocess per package); torch's CUDA, cuDNN, NCCL and the GPUs are read only where torch is
already imported (the stages), so the launcher never imports it. Standard library only.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

# Set in the training image (docker/Dockerfile) or by the docker runtime: the image a process runs
# in, and its digest when the reference does not hold one.
IMAGE_ENV = "CLIPFORGE_IMAGE"
IMAGE_DIGEST_ENV = "CLIPFORGE_IMAGE_DIGEST"
RESULT_KEY = "environment"  # the record's key in every result file


@dataclass(frozen=True, kw_only=True)
class Stack:
    """The software: versions of what decides the numbers, and a hash of everything else."""

    python: str
    torch: str | None
    cuda: str | None  # torch's CUDA (None: a CPU build, or torch not imported)
    cudnn: str | None
    nccl: str | None
    deepspeed: str | None
    open_clip: str | None
    transformers: str | None
    packages_sha256: str  # of the sorted `name==version` lines of every installed distribution
    num_packages: int


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The machine: its GPUs, or its CPU when it trains on none."""

    gpu_model: str | None
    gpu_count: int
    gpu_memory_mib: int | None
    gpu_driver: str | None
    cpu_model: str
    cpu_threads: int
    os: str
    kernel: str


@dataclass(frozen=True, kw_only=True)
class Runtime:
    host: str
    image: str | None  # the image reference (None: the host's own Python stack)
    image_digest: str | None


@dataclass(frozen=True, kw_only=True)
class Code:
    commit: str | None  # None: not run from a git checkout
    dirty: bool | None
    diff_sha256: str | None  # of `git diff HEAD` (None: a clean tree)


@dataclass(frozen=True, kw_only=True)
class EnvRecord:
    process: str  # what gathered it: "train stage", "eval stage", "fab train" (the launching side)
    code: Code
    params_sha256: str | None  # of the resolved params (the YAML the stage runs with)
    data_manifest_sha256: str | None  # of data/manifest.json
    runtime: Runtime
    stack: Stack
    hardware: Hardware
    # the seeds, world size and micro-batch plan of a training run (empty for eval)
    plan: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def from_dict(raw: dict) -> EnvRecord:
    """The one reader (a result file's `environment`); unknown keys of a newer writer ignored."""

    def part(cls, value):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (value or {}).items() if k in names})

    return EnvRecord(
        process=str(raw.get("process", "")),
        code=part(Code, raw.get("code")),
        params_sha256=raw.get("params_sha256"),
        data_manifest_sha256=raw.get("data_manifest_sha256"),
        runtime=part(Runtime, raw.get("runtime")),
        stack=part(Stack, raw.get("stack")),
        hardware=part(Hardware, raw.get("hardware")),
        plan=dict(raw.get("plan") or {}),
    )


def gather(
    process: str,
    *,
    params_text: str | None = None,
    data_manifest: str | Path | None = None,
    plan: dict | None = None,
    cwd: str | Path = ".",
    code: Code | None = None,
    environ: dict[str, str] | None = None,
) -> EnvRecord:
    """The one writer: this process's record. params_text: the resolved params YAML;
    data_manifest: the path of data/manifest.json; plan: seeds, world size, micro-batch plan;
    code: what runs, where it is not the checkout at cwd (a launch ships a commit)."""
    env = dict(os.environ if environ is None else environ)
    manifest = Path(data_manifest) if data_manifest else None
    return EnvRecord(
        process=process,
        code=code or code_at(str(Path(cwd).resolve())),
        params_sha256=sha256_text(params_text) if params_text is not None else None,
        data_manifest_sha256=_sha256_file(manifest) if manifest and manifest.is_file() else None,
        runtime=_runtime(env),
        stack=stack(),
        hardware=hardware(),
        plan=dict(plan or {}),
    )


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_at(cwd: str) -> Code:
    """The git checkout at cwd: HEAD, and `git diff HEAD`'s hash when the tree differs."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-c", f"safe.directory={cwd}", *args],
                cwd=cwd,
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.decode("utf-8", "replace") if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return Code(commit=None, dirty=None, diff_sha256=None)
    diff = git("diff", "HEAD", "--binary") or ""
    untracked = git("ls-files", "--others", "--exclude-standard") or ""
    dirty = bool(diff.strip() or untracked.strip())
    return Code(
        commit=commit.strip(),
        dirty=dirty,
        diff_sha256=sha256_text(diff + untracked) if dirty else None,
    )


def _runtime(env: dict[str, str]) -> Runtime:
    image = env.get(IMAGE_ENV) or None
    digest = env.get(IMAGE_DIGEST_ENV) or None
    if digest is None and image and "@sha256:" in image:
        digest = image.split("@", 1)[1]
    return Runtime(host=socket.gethostname(), image=image, image_digest=digest)


def installed_versions() -> dict[str, str]:
    """Every installed distribution's version, by normalised name (one metadata walk)."""
    versions: dict[str, str] = {}
    # Not the copies a package vendors: setuptools appends its `_vendor` folder to sys.path once
    # imported (DeepSpeed's op builder imports it mid-run), and its 9 copies would make the list
    # depend on when it is read (`fab rerun` compares one read before training with one after).
    paths = [p for p in sys.path if "_vendor" not in Path(p).parts]
    for dist in metadata.distributions(path=paths):
        name = dist.metadata["Name"]
        if name:
            versions.setdefault(_normalise(name), dist.version)
    return versions


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


@functools.lru_cache(maxsize=1)
def stack() -> Stack:
    versions = installed_versions()
    listing = "\n".join(f"{name}=={versions[name]}" for name in sorted(versions))
    torch = sys.modules.get("torch")  # only where the process already uses it
    cuda = cudnn = nccl = None
    if torch is not None:
        cuda = torch.version.cuda
        if cuda and torch.backends.cudnn.is_available():
            cudnn = str(torch.backends.cudnn.version())
        if cuda and hasattr(torch.cuda, "nccl"):
            try:
                nccl = ".".join(str(p) for p in torch.cuda.nccl.version())
            except (RuntimeError, AttributeError, TypeError):
                nccl = None
    return Stack(
        python=platform.python_version(),
        # torch's own, with its local tag (2.4.0+cu121), where the process imported it
        torch=torch.__version__ if torch is not None else versions.get("torch"),
        cuda=cuda,
        cudnn=cudnn,
        nccl=nccl or versions.get("nvidia-nccl-cu12") or versions.get("nvidia-nccl-cu13"),
        deepspeed=versions.get("deepspeed"),
        open_clip=versions.get("open-clip-torch"),
        transformers=versions.get("transformers"),
        packages_sha256=sha256_text(listing),
        num_packages=len(versions),
    )


@functools.lru_cache(maxsize=1)
def hardware() -> Hardware:
    torch = sys.modules.get("torch")
    gpus = torch.cuda.device_count() if torch is not None and torch.cuda.is_available() else 0
    model = memory = driver = None
    if torch is not None and gpus:
        props = torch.cuda.get_device_properties(0)
        model, memory = props.name, props.total_memory // (1 << 20)
        driver = _nvidia_driver()
    return Hardware(
        gpu_model=model,
        gpu_count=gpus,
        gpu_memory_mib=memory,
        gpu_driver=driver,
        cpu_model=_cpu_model(),
        cpu_threads=os.cpu_count() or 0,
        os=platform.platform(),
        kernel=platform.release(),
    )


def _nvidia_driver() -> str | None:
    try:  # the driver's own file: no NVML, no subprocess
        text = Path("/proc/driver/nvidia/version").read_text(encoding="utf-8")
    except OSError:
        return None
    words = text.split()
    return next((w for w in words if w[:1].isdigit() and w.count(".") >= 1), None)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def card_lines(record: dict) -> list[str]:
    """The model card's `Environment` section: the record's key facts, one line each."""
    env = from_dict(record)
    code, stack_, hw, rt = env.code, env.stack, env.hardware, env.runtime
    dirty = "" if not code.dirty else f" (dirty, diff sha256 {code.diff_sha256})"
    gpus = f"{hw.gpu_count} x {hw.gpu_model}" if hw.gpu_count else f"CPU only: {hw.cpu_model}"
    return [
        f"- commit: `{code.commit or 'unknown'}`{dirty}",
        f"- resolved params sha256: `{env.params_sha256 or 'unknown'}`",
        f"- data manifest sha256: `{env.data_manifest_sha256 or 'unknown'}`",
        f"- runtime: {rt.image + ' ' + (rt.image_digest or '') if rt.image else 'host ' + rt.host}",
        f"- Python {stack_.python}, torch {stack_.torch} (CUDA {stack_.cuda}, cuDNN "
        f"{stack_.cudnn}, NCCL {stack_.nccl}), DeepSpeed {stack_.deepspeed}, open_clip "
        f"{stack_.open_clip}, transformers {stack_.transformers}; all {stack_.num_packages} "
        f"packages sha256 `{stack_.packages_sha256}`",
        f"- hardware: {gpus}, {hw.cpu_threads} CPU threads; {hw.os}",
        f"- plan: {', '.join(f'{k} {v}' for k, v in env.plan.items()) or 'none'}",
    ]
