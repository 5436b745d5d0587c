#!/usr/bin/env python3
"""Time `make image-cpu` cold and cached, and a container's start, on a private Docker engine.

Cold: a fresh, empty data root, so the Debian base (debootstrap) and the whole image are made;
cached: the same command again, which must find the image by the hash of its inputs. Then one
`docker run` of the image that imports the stack. The engine and its data root are removed at the
end (several GB).

    sudo .venv/bin/python bench/cpu_image_build.py    (root: dockerd and debootstrap)

Record the printed table in BENCHMARKS.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.support.dockerd import start_dockerd  # noqa: E402


def timed(command: list[str], env: dict) -> tuple[float, str]:
    began = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - began, result.stdout.strip()


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="clipforge-bench-dockerd-"))
    engine = start_dockerd(root)
    try:
        env = {**os.environ, **engine.env, "PYTHON": sys.executable}
        build = [str(REPO / "docker" / "build-cpu.sh")]
        cold, reference = timed(build, env)
        cached, again = timed(build, env)
        assert again == reference, (reference, again)
        probe = "import torch, deepspeed, dvc, open_clip"
        run = ["docker", "run", "--rm", "--user", "1000:1000", reference, "python", "-c", probe]
        started, _ = timed(run, env)
        size = engine.docker("image", "inspect", "--format", "{{.Size}}", reference).stdout
        driver = engine.docker("info", "--format", "{{.Driver}}").stdout.strip()
    finally:
        engine.stop()
        shutil.rmtree(root, ignore_errors=True)
        root.with_name(root.name + ".log").unlink(missing_ok=True)
    print(f"| image | {reference} ({int(size) / 1e9:.2f} GB, storage driver {driver}) |")
    print(f"| cold build (base + image) | {cold:.0f} s |")
    print(f"| cached (`make image-cpu` again) | {cached:.1f} s |")
    print(f"| `docker run` importing torch, deepspeed, dvc, open_clip | {started:.1f} s |")


if __name__ == "__main__":
    main()
