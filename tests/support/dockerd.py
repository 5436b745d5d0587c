"""A private Docker engine for tests: its own dockerd, socket and exec root, never the machine's.

    engine = start_dockerd()              # or the session fixture `docker_engine`
    engine.env                            # {"DOCKER_HOST": "unix:///tmp/cfd-.../docker.sock"}
    engine.stop()                         # stops it; its containers go with it

    python -m tests.support.dockerd CMD...  # CMD against a private engine, then stop it (.ci/run
                                            # builds the CPU image this way while tests run)

The data root (images, the build cache) persists in ~/.cache/clipforge/dockerd (or
$CLIPFORGE_DOCKERD_ROOT), so the CPU image built once is found again by the next test session
(docker/build-cpu.sh tags it by a hash of its inputs). The exec root, which holds the sockets, is
a short temporary path (unix socket paths are limited to 108 bytes) removed on stop. No bridge, no
iptables: containers use the host's network (`--network host`), as the launcher runs them. The
storage driver is dockerd's own choice (overlay2 where the kernel allows it, else vfs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support.wait import wait_for

DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"
START_TIMEOUT_SECONDS = 60.0


class DockerUnavailable(RuntimeError):
    """No dockerd can be started here; the message says why."""


def data_root() -> Path:
    configured = os.environ.get("CLIPFORGE_DOCKERD_ROOT")
    return Path(configured) if configured else Path.home() / ".cache" / "clipforge" / "dockerd"


@dataclass
class DockerEngine:
    exec_root: Path
    process: subprocess.Popen
    log: Path

    @property
    def socket(self) -> Path:
        return self.exec_root / "docker.sock"

    @property
    def env(self) -> dict[str, str]:
        return {"DOCKER_HOST": f"unix://{self.socket}"}

    def docker(self, *args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker", *args],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            check=check,
            **kwargs,
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Stop dockerd (it stops its containers first) and remove the exec root."""
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # dockerd leaves its network namespace file mounted under the exec root
        for mount in _mounts_under(self.exec_root):
            subprocess.run(["umount", "--lazy", mount], check=False)
        shutil.rmtree(self.exec_root, ignore_errors=True)


def start_dockerd(root: Path | None = None) -> DockerEngine:
    if os.geteuid() != 0:
        raise DockerUnavailable("dockerd needs root")
    if not Path(DOCKERD).exists():
        raise DockerUnavailable(
            "dockerd is not installed (scripts/setup-system.sh installs Debian's docker.io)"
        )
    root = root or data_root()
    root.mkdir(parents=True, exist_ok=True)
    exec_root = Path(tempfile.mkdtemp(prefix="cfd-", dir="/tmp"))
    log = root.with_name(root.name + ".log")  # beside the data root: kept for a post-mortem
    process = subprocess.Popen(
        [
            DOCKERD,
            "--data-root",
            str(root),
            "--exec-root",
            str(exec_root),
            "--pidfile",
            str(exec_root / "dockerd.pid"),
            "-H",
            f"unix://{exec_root / 'docker.sock'}",
            "--iptables=false",
            "--ip-masq=false",
            "--bridge=none",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),
        start_new_session=True,
    )
    engine = DockerEngine(exec_root=exec_root, process=process, log=log)

    def alive() -> None:
        if not engine.alive():
            raise DockerUnavailable(f"dockerd exited: {log.read_text(errors='replace')[-2000:]}")

    try:
        wait_for(
            lambda: engine.socket.exists() and engine.docker("info", check=False).returncode == 0,
            what="dockerd answering",
            timeout=START_TIMEOUT_SECONDS,
            interval=0.2,
            check=alive,
            error=DockerUnavailable,
        )
    except DockerUnavailable:
        engine.stop()
        raise
    return engine


def _mounts_under(directory: Path) -> list[str]:
    prefix = str(directory) + "/"
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        points = [line.split()[1] for line in mounts]
    return sorted((p for p in points if p.startswith(prefix)), reverse=True)


def _run_against_a_private_engine(command: list[str]) -> int:
    engine = start_dockerd()
    try:
        return subprocess.run(command, env={**os.environ, **engine.env}, check=False).returncode
    finally:
        engine.stop()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m tests.support.dockerd CMD [ARG...]")
    sys.exit(_run_against_a_private_engine(sys.argv[1:]))
