"""A real OpenSSH server with throwaway keys, and a way to run the real `fab`.

The "remote host" is this machine: sshd runs as the current user (root in CI containers too),
key-only, with its own config, host key and authorized_keys in a temporary directory. It listens
on 127.0.0.1, or inside a network namespace on that namespace's address (tests/support/netns.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support.wait import wait_for

SSHD = Path("/usr/sbin/sshd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path) -> Path:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "clipforge-test", "-f", str(path)],
        check=True,
    )
    return path


@dataclass
class SshServer:
    port: int
    user: str
    client_key: Path  # authorized
    host_public_key: str  # "ssh-ed25519 AAAA..."
    process: subprocess.Popen
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def known_hosts_line(self) -> str:
        kind, blob = self.host_public_key.split()[:2]
        name = self.host if self.port == 22 else f"[{self.host}]:{self.port}"
        return f"{name} {kind} {blob}\n"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def start_sshd(
    directory: Path,
    *,
    listen: str = "127.0.0.1",
    port: int | None = None,
    netns: str | None = None,
    client_key: Path | None = None,
    set_env: dict[str, str] | None = None,
) -> SshServer:
    """sshd on `listen`:`port` (a free one by default), in network namespace `netns` if given,
    authorizing `client_key` (a new one by default); `set_env` reaches every session."""
    directory.mkdir(parents=True, exist_ok=True)
    host_key = keygen(directory / "ssh_host_ed25519_key")
    client_key = client_key or keygen(directory / "client_key")
    authorized = directory / "authorized_keys"
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    for path in (host_key, client_key, authorized):
        path.chmod(0o600)
    user = _user()
    port = port or free_port()
    passed = {k: os.environ[k] for k in ("OMP_WAIT_POLICY",) if k in os.environ}  # conftest.py
    environment = " ".join(f"{k}={v}" for k, v in {**passed, **(set_env or {})}.items())
    home = directory / "home"
    home.mkdir(exist_ok=True)
    config = directory / "sshd_config"
    config.write_text(f"""\
Port {port}
ListenAddress {listen}
HostKey {host_key}
PidFile {directory / "sshd.pid"}
AuthorizedKeysFile {authorized}
AllowUsers {user}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The temporary directory belongs to the test, not to a hardened home.
StrictModes no
# What a run writes in the SSH user's home (its list of run roots) stays in the test's.
SetEnv HOME={home} {environment}
PermitRootLogin prohibit-password
Subsystem sftp internal-sftp
LogLevel ERROR
""")
    if os.geteuid() == 0:
        # sshd started as root insists on its privilege separation directory; the Debian package
        # creates it only when the service starts, which no container does.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    in_netns = ["ip", "netns", "exec", netns] if netns else []
    process = subprocess.Popen(
        [*in_netns, str(SSHD), "-D", "-e", "-f", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(directory / "sshd.log", "wb"),
    )

    def alive() -> None:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited: {(directory / 'sshd.log').read_text()}")

    try:
        wait_for(
            lambda: _listening(process.pid, port),
            what="sshd listening",
            timeout=120,  # a safety limit: sshd starts in well under a second on a quiet box
            interval=0.1,
            check=alive,
            error=RuntimeError,
        )
    except RuntimeError:
        process.terminate()
        raise
    public = (directory / "ssh_host_ed25519_key.pub").read_text().strip()
    return SshServer(
        port=port,
        user=user,
        client_key=client_key,
        host_public_key=public,
        process=process,
        host=listen,
    )


def _listening(pid: int, port: int) -> bool:
    """Whether a TCP socket listens on `port` in the network namespace of process `pid` (its
    /proc/PID/net/tcp is that namespace's table, readable from outside it)."""
    try:
        rows = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    # columns: sl local_address rem_address st ...; st 0A = LISTEN; the port is hex
    return any(row.split()[1].endswith(f":{port:04X}") and row.split()[3] == "0A" for row in rows)


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


@dataclass
class FabRunner:
    """Runs `python -m fabric` (the `fab` CLI) in a project checkout, as a user would."""

    project: Path
    home: Path  # HOME of the fab process: its ~/.ssh/known_hosts
    env: dict
    prefix: tuple[str, ...] = ()  # e.g. `ip netns exec NS`: run it on another "machine"

    def __call__(
        self,
        *args: str,
        hosts: str | None = None,
        key: Path | None = None,
        timeout: float = 300,
        env: dict | None = None,
    ) -> subprocess.CompletedProcess:
        argv = [*self.prefix, sys.executable, "-m", "fabric"]
        if hosts:
            argv += ["-H", hosts]
        if key:
            argv += ["-i", str(key)]
        return subprocess.run(
            argv + list(args),
            cwd=self.project,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def popen(self, *args: str, hosts: str, key: Path) -> subprocess.Popen:
        argv = [*self.prefix, sys.executable, "-m", "fabric", "-H", hosts, "-i", str(key), *args]
        return subprocess.Popen(
            argv,
            cwd=self.project,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
