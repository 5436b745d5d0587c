"""`fab check`: can this host run the training we are about to ask of it?

Each check is a row: name, ok/FAIL/skip, and what was found. A GPU check that cannot find the
GPUs asked for (`--gpus`) fails; `--gpus 0` (a CPU run) skips it. `fab train` runs the same checks
on every node before it ships or starts anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fabric import Connection

from clipforge.launcher.connection import probe, q

OK, FAIL, SKIP = "ok", "FAIL", "skip"


@dataclass(frozen=True)
class Row:
    name: str
    status: str
    detail: str


@dataclass(frozen=True)
class CheckSpec:
    gpus: int
    runtime: str  # docker | host
    image: str
    remote_root: str
    python: str
    min_free_gb: float
    data_path: str | None = None  # --data /mounted/path
    mounts: tuple[tuple[str, str], ...] = ()  # (role, path) from the stack outputs


def run_checks(cxn: Connection, spec: CheckSpec) -> list[Row]:
    rows = [Row("ssh", OK, _one_line(probe(cxn, "uname -nsr").stdout))]
    checks: list[Callable[[Connection, CheckSpec], Row]] = [_gpus, _disk, _storage, _git]
    checks += [_docker, _image] if spec.runtime == "docker" else [_python_env]
    if spec.data_path:
        checks.append(_data)
    rows += [check(cxn, spec) for check in checks]
    rows += [_mount(cxn, role, path) for role, path in spec.mounts]
    return rows


def unreachable(error: str) -> list[Row]:
    return [Row("ssh", FAIL, error)]


def _gpus(cxn: Connection, spec: CheckSpec) -> Row:
    if spec.gpus == 0:
        return Row("gpus", SKIP, "--gpus 0: a CPU run")
    result = probe(
        cxn, "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"
    )
    if not result.ok:
        why = (
            "nvidia-smi not found"
            if result.exited == 127
            else _one_line(result.stderr or result.stdout)
        )
        return Row("gpus", FAIL, f"--gpus {spec.gpus} asked, no GPU visible ({why})")
    gpus = [line.split(", ") for line in result.stdout.strip().splitlines() if line.strip()]
    if len(gpus) < spec.gpus:
        return Row("gpus", FAIL, f"--gpus {spec.gpus} asked, {len(gpus)} found")
    name, memory, driver = (gpus[0] + ["?", "?", "?"])[:3]
    return Row("gpus", OK, f"{len(gpus)} x {name}, {memory}, driver {driver}")


def _disk(cxn: Connection, spec: CheckSpec) -> Row:
    # The root may not exist yet: measure the nearest existing parent.
    result = probe(
        cxn,
        f'p={q(spec.remote_root)}; while [ ! -e "$p" ]; do p=$(dirname "$p"); '
        f'done; df -Pk "$p" | tail -1',
    )
    fields = result.stdout.split()
    if not result.ok or len(fields) < 4 or not fields[3].isdigit():
        return Row("disk", FAIL, f"could not measure free space: {_one_line(result.stderr)}")
    free_gb = int(fields[3]) / 1024**2
    status = OK if free_gb >= spec.min_free_gb else FAIL
    return Row(
        "disk", status, f"{free_gb:.1f} GiB free at {spec.remote_root} (need {spec.min_free_gb:g})"
    )


def _storage(cxn: Connection, spec: CheckSpec) -> Row:
    probe_file = f"{spec.remote_root}/.clipforge-write-test"
    result = probe(
        cxn, f"mkdir -p {q(spec.remote_root)} && echo ok > {q(probe_file)} && rm -f {q(probe_file)}"
    )
    if not result.ok:
        return Row("storage", FAIL, f"{spec.remote_root} not writable: {_one_line(result.stderr)}")
    return Row("storage", OK, f"{spec.remote_root} writable")


def _git(cxn: Connection, spec: CheckSpec) -> Row:
    result = probe(cxn, "git --version")
    if not result.ok:
        return Row(
            "git", FAIL, "git not found: the code is shipped as a git bundle and cloned there"
        )
    return Row("git", OK, _one_line(result.stdout))


def _docker(cxn: Connection, spec: CheckSpec) -> Row:
    result = probe(cxn, "docker info --format '{{.ServerVersion}} {{json .Runtimes}}'")
    if not result.ok:
        return Row(
            "docker",
            FAIL,
            f"docker not usable: {_one_line(result.stderr or result.stdout)}; "
            f"install it, or use --runtime host inside the image",
        )
    version, _, runtimes = result.stdout.strip().partition(" ")
    if spec.gpus and "nvidia" not in runtimes:
        return Row(
            "docker",
            FAIL,
            f"docker {version} has no nvidia runtime: install the NVIDIA "
            f"Container Toolkit (nvidia-ctk runtime configure)",
        )
    return Row(
        "docker", OK, f"docker {version}" + (" with the nvidia runtime" if spec.gpus else "")
    )


def _image(cxn: Connection, spec: CheckSpec) -> Row:
    present = probe(cxn, f"docker image inspect --format '{{{{.Id}}}}' {q(spec.image)}")
    if present.ok:
        # The ID, so that the nodes of a run can be held to the same image (stack_mismatch).
        return Row("image", OK, f"{spec.image} present ({present.stdout.strip()[:19]})")
    if probe(cxn, f"docker manifest inspect {q(spec.image)}").ok:
        return Row("image", OK, f"{spec.image} pullable")
    return Row(
        "image",
        FAIL,
        f"{spec.image} neither present nor pullable: push it (`make "
        f"image-push REGISTRY=...` in the project), `docker login` on the "
        f"host, or load it with `docker load`",
    )


def _python_env(cxn: Connection, spec: CheckSpec) -> Row:
    # Installed versions, read without importing (importing torch + DeepSpeed takes many seconds;
    # whether they really work on this host is what `fab train --smoke` finds out).
    script = (
        "import sys; from importlib.metadata import version; "
        "print(sys.version.split()[0], *(version(p) for p in "
        "('torch', 'deepspeed', 'dvc', 'open_clip_torch')))"
    )
    result = probe(cxn, f"{q(spec.python)} -c {q(script)}")
    if not result.ok:
        return Row(
            "python env",
            FAIL,
            f"{spec.python}: {_one_line(result.stderr or result.stdout)}: --runtime host "
            f"trains with this Python; give the host the stack (`make env` in a clone of the "
            f"project there, then set clipforge.python to its .venv/bin/python), or use "
            f"--runtime docker with a pushed image",
        )
    py, torch, ds, dvc, clip = (result.stdout.split() + ["?"] * 5)[:5]
    return Row(
        "python env", OK, f"python {py}, torch {torch}, deepspeed {ds}, dvc {dvc}, open_clip {clip}"
    )


def _data(cxn: Connection, spec: CheckSpec) -> Row:
    manifest = f"{spec.data_path}/manifest.json"
    if not probe(cxn, f"test -r {q(manifest)}").ok:
        return Row("data", FAIL, f"{manifest} not found: --data PATH must hold a data stage output")
    return Row("data", OK, f"{spec.data_path} has a manifest")


def _mount(cxn: Connection, role: str, path: str) -> Row:
    name = f"volume {role}"
    if not probe(cxn, f"test -d {q(path)}").ok:
        return Row(name, FAIL, f"{path} not mounted")
    if role == "datasets":
        return Row(name, OK, f"{path} mounted")
    writable = probe(cxn, f"test -w {q(path)}").ok
    return Row(
        name, OK if writable else FAIL, f"{path} mounted" + ("" if writable else ", NOT writable")
    )


# What every node of a run must agree on: the image (by ID) or the host's own stack (versions).
STACK_ROWS = ("image", "python env")


def stack_mismatch(labels: list[str], results: list[list[Row]]) -> str | None:
    """Which of STACK_ROWS differs between the nodes, naming each node's; None when all agree."""
    for name in STACK_ROWS:
        details = [next((r.detail for r in rows if r.name == name), None) for rows in results]
        if len(set(details)) > 1:
            listing = "; ".join(f"{label}: {detail}" for label, detail in zip(labels, details))
            return (
                f"the nodes do not run the same {name} ({listing}): every node of a run needs "
                f"the same one"
            )
    return None


def format_table(host: str, rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{host}"] + [f"  {r.name:<{width}}  {r.status:<4}  {r.detail}" for r in rows]
    return "\n".join(lines)


def failed(rows: list[Row]) -> bool:
    return any(r.status == FAIL for r in rows)


def _one_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"
