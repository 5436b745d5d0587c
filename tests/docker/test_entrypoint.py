"""docker/entrypoint.sh run directly on this machine: the version report, exec of the command,
and a real OpenSSH server on 127.0.0.1 started the way the image starts it (as a non-root user,
key-only, port and key paths as in the image)."""

from __future__ import annotations

import importlib.metadata
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.docker.conftest import DOCKER_DIR
from tests.support.wait import wait_for

ENTRYPOINT = str(DOCKER_DIR / "entrypoint.sh")


def base_env(tmp_path: Path, **extra: str) -> dict:
    """This Python first on PATH (as the image's venv is), and a bin/ for stand-in tools."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    path = os.pathsep.join(
        [str(tmp_path / "bin"), str(Path(sys.executable).parent), "/usr/bin", "/bin"]
    )
    return {"PATH": path, "HOME": str(tmp_path), **extra}


def run(args, env, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [ENTRYPOINT, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        **kwargs,
    )


def test_reports_versions_commit_and_gpus_then_runs_the_command(tmp_path):
    """stderr names python, torch (+ its CUDA), DeepSpeed, open_clip, clipforge, the git commit and
    what nvidia-smi lists; stdout is the command's alone."""
    nvidia_smi = tmp_path / "bin" / "nvidia-smi"
    env = base_env(tmp_path, CLIPFORGE_GIT_COMMIT="0123abcd")
    nvidia_smi.write_text(
        "#!/bin/sh\n[ \"$1\" = -L ] && echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)'\n"
    )
    nvidia_smi.chmod(0o755)
    result = run(["echo", "the command ran"], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "the command ran\n"
    import torch

    for expected in (
        f"python {sys.version.split()[0]}",
        f"torch {torch.__version__}",
        f"CUDA {torch.version.cuda}",
        f"deepspeed {importlib.metadata.version('deepspeed')}",
        f"open_clip {importlib.metadata.version('open_clip_torch')}",
        "git commit 0123abcd",
        "GPU 0: NVIDIA H100 80GB HBM3",
        "GPUs visible to torch: 0",
    ):
        assert expected in result.stderr, expected


def test_without_nvidia_smi_says_so_and_still_runs(tmp_path):
    """No driver in the container: the report says nvidia-smi is missing; the command runs anyway."""
    result = run(["true"], base_env(tmp_path))
    assert result.returncode == 0
    assert "nvidia-smi: not found" in result.stderr


def test_command_replaces_the_entrypoint_and_keeps_its_exit_code(tmp_path):
    """exec: the command has the entrypoint's PID (so it gets the container's signals) and its exit
    code is the container's."""
    proc = subprocess.Popen(
        [ENTRYPOINT, "sh", "-c", "echo $$; exit 7"],
        env=base_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 7
    assert int(out.strip()) == proc.pid


@pytest.mark.parametrize("umask, expected", [("022", "0027"), ("002", "0027"), ("077", "0077")])
def test_the_command_writes_group_readable_at_most(tmp_path, umask, expected):
    """The container's command runs with 027 added to the umask (clipforge.fsutil.RUN_UMASK), a
    stricter one kept: what a run writes in the image is never readable by every user."""
    result = subprocess.run(
        ["sh", "-c", f'umask {umask}; exec "$0" sh -c umask', ENTRYPOINT],
        env=base_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_environment_from_stdin_reaches_the_command_and_nothing_else(tmp_path):
    """CLIPFORGE_ENV_FROM_STDIN=A,B: one line per name on stdin; an empty line leaves its name
    unset; the command then reads an empty stdin and does not see the variable list."""
    env = base_env(tmp_path, CLIPFORGE_ENV_FROM_STDIN="HOOKS,FAULTS")
    script = (
        'echo "hooks=$HOOKS faults=${FAULTS-unset} list=${CLIPFORGE_ENV_FROM_STDIN-unset}"; cat'
    )
    result = run(["sh", "-c", script], env, input="slack:https://x/y z\n\nnot for the command\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hooks=slack:https://x/y z faults=unset list=unset\n"


def test_a_bad_name_in_the_stdin_environment_is_refused(tmp_path):
    result = run(["true"], base_env(tmp_path, CLIPFORGE_ENV_FROM_STDIN="OK,BAD-NAME"), input="")
    assert result.returncode != 0 and "'BAD-NAME' is not a variable name" in result.stderr


def test_no_command_is_an_error(tmp_path):
    """Without a command (the image's CMD is bash) the entrypoint fails with a message."""
    result = run([], base_env(tmp_path))
    assert result.returncode != 0 and "no command given" in result.stderr


def test_sshd_switch_accepts_only_0_or_1(tmp_path):
    """CLIPFORGE_SSHD=yes is refused, naming the allowed values, before the command runs."""
    result = run(["echo", "ran"], base_env(tmp_path, CLIPFORGE_SSHD="yes"))
    assert result.returncode != 0 and "use 1" in result.stderr and "ran" not in result.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal concerns running as root")
def test_sshd_refuses_to_run_as_root(tmp_path):
    """As root (a container started with --user 0), CLIPFORGE_SSHD=1 is refused: sshd runs only
    as the non-root user."""
    result = run(["echo", "ran"], base_env(tmp_path, CLIPFORGE_SSHD="1"))
    assert result.returncode != 0 and "refusing to start sshd as root" in result.stderr
    assert "ran" not in result.stdout


# --- a real sshd, as a non-root user ---------------------------------------------------------


def login_user() -> pwd.struct_passwd | None:
    """A non-root account with a real shell and home, to run sshd as (like uid 1000 in the image)."""
    shells = set(Path("/etc/shells").read_text().split()) if Path("/etc/shells").exists() else set()
    for entry in sorted(pwd.getpwall(), key=lambda e: e.pw_uid):
        if entry.pw_uid >= 1000 and entry.pw_shell in shells and Path(entry.pw_dir).is_dir():
            return entry
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sshd_as_user(tmp_path):
    """Start the entrypoint with CLIPFORGE_SSHD=1 as a non-root user; yield what a client needs."""
    user = login_user()
    if os.geteuid() != 0 or user is None or shutil.which("sshd", path="/usr/sbin:/usr/bin") is None:
        pytest.skip("needs root (to switch to a non-root user), such a user, and openssh-server")
    # sshd checks that no one else can write the key files' directories up to / (StrictModes):
    # /run qualifies (root-owned 755), pytest's /tmp does not.
    root = Path(tempfile.mkdtemp(prefix="clipforge-sshd-test-", dir="/run"))
    root.chmod(0o755)
    sshd_dir, secret = root / "sshd", root / "secret"
    sshd_dir.mkdir()
    secret.mkdir()
    os.chown(sshd_dir, user.pw_uid, user.pw_gid)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client")], check=True
    )
    shutil.copy(root / "client.pub", secret / "authorized_keys")
    port = free_port()
    env = {
        **base_env(
            tmp_path,
            CLIPFORGE_SSHD="1",
            CLIPFORGE_SSHD_PORT=str(port),
            CLIPFORGE_SSH_AUTHORIZED_KEYS=str(secret / "authorized_keys"),
            CLIPFORGE_SSHD_DIR=str(sshd_dir),
        ),
        "HOME": user.pw_dir,
    }
    as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups"]
    result = subprocess.run(
        [*as_user, ENTRYPOINT, "echo", "command ran"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    try:
        yield {
            "result": result,
            "user": user,
            "port": port,
            "key": root / "client",
            "env": env,
            "sshd_dir": sshd_dir,
        }
    finally:
        pid_file = sshd_dir / "sshd.pid"
        if pid_file.exists():
            os.kill(int(pid_file.read_text().split()[0]), 15)
        shutil.rmtree(root, ignore_errors=True)


def ssh(server: dict, user: str, command: str, key: bool = True) -> subprocess.CompletedProcess:
    options = [
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "ConnectTimeout=10",
        "-p",
        str(server["port"]),
    ]
    if key:
        options += ["-i", str(server["key"]), "-o", "IdentitiesOnly=yes"]
    else:
        options += ["-o", "PubkeyAuthentication=no"]
    return subprocess.run(
        ["ssh", *options, f"{user}@127.0.0.1", command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def wait_listening(port: int, seconds: float = 10.0) -> None:
    def answers() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(answers, what=f"a listener on 127.0.0.1:{port}", timeout=seconds, interval=0.1)


def test_sshd_starts_then_the_command_runs(sshd_as_user):
    """With CLIPFORGE_SSHD=1 sshd listens on the given port and the command still runs."""
    result = sshd_as_user["result"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == "command ran\n"
    assert f"sshd listening on port {sshd_as_user['port']}" in result.stderr
    wait_listening(sshd_as_user["port"])


def test_ssh_login_with_the_mounted_key_gets_the_containers_environment(sshd_as_user):
    """The key in the mounted authorized_keys logs in as the container's user, and the session has
    the container's PATH (DeepSpeed's multi-node launcher runs its command over such a session)."""
    wait_listening(sshd_as_user["port"])
    user = sshd_as_user["user"].pw_name
    result = ssh(sshd_as_user, user, 'id -un; echo "PATH=$PATH"')
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == user
    assert lines[1] == f"PATH={sshd_as_user['env']['PATH']}"


def test_sshd_offers_public_key_authentication_only(sshd_as_user):
    """Without a key there is no other way in: the server lists publickey as its only method."""
    wait_listening(sshd_as_user["port"])
    result = ssh(sshd_as_user, sshd_as_user["user"].pw_name, "true", key=False)
    assert result.returncode == 255
    assert "Permission denied (publickey)" in result.stderr


def test_sshd_admits_no_other_user(sshd_as_user):
    """The right key for another account (root) is refused: sshd serves the container user only."""
    wait_listening(sshd_as_user["port"])
    result = ssh(sshd_as_user, "root", "true")
    assert result.returncode == 255 and "Permission denied" in result.stderr


def test_missing_authorized_keys_is_an_error_naming_the_path(sshd_as_user, tmp_path):
    """CLIPFORGE_SSHD=1 without the mounted keys: exit non-zero naming the expected file, and the
    command does not run (a node nobody can reach would hang a multi-node launch)."""
    user = sshd_as_user["user"]
    env = {
        **sshd_as_user["env"],
        "CLIPFORGE_SSH_AUTHORIZED_KEYS": "/etc/clipforge/ssh/absent",
        "CLIPFORGE_SSHD_PORT": str(free_port()),
    }
    result = subprocess.run(
        [
            "setpriv",
            f"--reuid={user.pw_uid}",
            f"--regid={user.pw_gid}",
            "--init-groups",
            ENTRYPOINT,
            "echo",
            "ran",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "/etc/clipforge/ssh/absent is missing or empty" in result.stderr
    assert "ran" not in result.stdout
