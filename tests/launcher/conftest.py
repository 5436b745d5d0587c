"""Fixtures of the launcher tests: a real sshd on 127.0.0.1, a project commit, the real `fab`.

Every test gets its own remote run root. The training runs use the reduced config of
tests/conftest.py plus a few settings (RUN_SETS); a run shared by several test modules is a
session fixture here (smoke_run), one shared by a module's tests a fixture of that module.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SMALL_PARAMS, set_args
from tests.support.netns import NetnsUnavailable, test_network
from tests.support.sshd import FabRunner, start_sshd
from tests.support.wait import wait_for
from tests.support.webhooks import WebhookServer


# The reduced config as --set overrides (values as YAML, like `dvc exp run -S`), and the run shape
# every training test shares: 8 steps, a checkpoint every 2, a metrics row every step.
def _as_sets(params: dict) -> list[str]:
    return [
        f"{section}.{key}={json.dumps(value)}"
        for section in ("data", "model", "train")
        for key, value in params[section].items()
    ]


SMALL_SETS = _as_sets(SMALL_PARAMS)
RUN_SETS = [
    *_as_sets(
        {
            **SMALL_PARAMS,
            "train": {
                **SMALL_PARAMS["train"],
                "max_steps": 8,
                "save_every_steps": 2,
                "log_every_steps": 1,
                "warmup_steps": 1,
            },
        }
    ),
    # a run alerting to a dead webhook waits this long at its end (default 30 s)
    "alerts.flush_timeout_seconds=1",
]


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def netns_hosts(tmp_path_factory):
    """Two hosts of their own, `a` and `b`, and a laptop namespace to reach them from
    (tests/support/netns.py); skipped, saying why, where namespaces cannot be made."""
    stack = contextlib.ExitStack()
    try:
        net = stack.enter_context(test_network(tmp_path_factory.mktemp("netns")))
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    with stack:
        yield net


def make_fab(
    project: Path, home: Path, remote_root: Path, *servers, prefix: tuple[str, ...] = ()
) -> FabRunner:
    """`fab` as a user runs it in the project: HOME with a known_hosts that knows the servers;
    `prefix` runs it elsewhere (in the laptop's network namespace)."""
    (home / ".ssh").mkdir(parents=True, exist_ok=True, mode=0o700)
    known = home / ".ssh" / "known_hosts"
    if not known.exists():
        known.write_text("".join(server.known_hosts_line for server in servers))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SSH_AUTH_SOCK", "REGISTRY") and not k.startswith("FABRIC_")
    }
    env.update(
        {
            "HOME": str(home),
            "PYTHONPATH": str(project / "src"),
            # The host side runs with the interpreter running these tests (this machine is the host).
            "FABRIC_CLIPFORGE_PYTHON": sys.executable,
            "FABRIC_CLIPFORGE_REMOTE_ROOT": str(remote_root),
            "FABRIC_CLIPFORGE_MIN_FREE_GB": "1",
            "FABRIC_CLIPFORGE_BACKOFF_SECONDS": "1",
            "FABRIC_CLIPFORGE_BACKOFF_MAX_SECONDS": "2",
            "FABRIC_CLIPFORGE_STOP_TIMEOUT_SECONDS": "180",
        }
    )
    return FabRunner(project=project, home=home, env=env, prefix=prefix)


@pytest.fixture
def remote_root(tmp_path) -> Path:
    return tmp_path / "remote"


@pytest.fixture
def fab(project, tmp_path, remote_root, sshd) -> FabRunner:
    return make_fab(project, tmp_path / "home", remote_root, sshd)


# The states a supervisor ends a node in.
ENDED = ("failed", "stopped", "finished")


# -- runs --------------------------------------------------------------------------------------
class LaunchedRun:
    """A run started by `fab train`, observed on the host (this machine) and through `fab`."""

    def __init__(self, fab: FabRunner, sshd, root: Path, launch: subprocess.CompletedProcess):
        assert launch.returncode == 0, launch.stdout + launch.stderr
        self.fab, self.sshd, self.root, self.launch = fab, sshd, root, launch
        self.launch_id = next(
            line.split()[2]
            for line in launch.stdout.splitlines()
            if line.startswith("started run ")
        )
        self.state_at_return = self.state()

    @property
    def node_dir(self) -> Path:
        return self.root / "runs" / self.launch_id / "node-0"

    @property
    def code(self) -> Path:
        return self.node_dir / "code"

    def state(self) -> dict:
        return json.loads((self.node_dir / "state.json").read_text())

    def run_fab(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return self.fab(*args, hosts=self.sshd.address, key=self.sshd.client_key, **kwargs)

    def wait_until(self, predicate, timeout: float = 600, what: str = "the run") -> None:
        """Poll the host until predicate() holds (a safety limit, not a speed assertion)."""

        def not_ended() -> None:
            if self.state().get("state") in ENDED and not predicate():
                raise AssertionError(
                    f"{what}: run ended as {self.state()} first; log:\n"
                    + (self.node_dir / "train.log").read_text()[-3000:]
                )

        wait_for(predicate, what=what, timeout=timeout, check=not_ended)

    def wait_finished(self, timeout: float = 600) -> dict:
        return wait_for_end(self.node_dir, timeout)


def wait_for_end(node_dir: Path, timeout: float = 600) -> dict:
    """The node's final state, once its supervisor has recorded one (the timeout is a safety
    limit, not a speed assertion)."""

    def final_state() -> dict | None:
        state = json.loads((node_dir / "state.json").read_text())
        return state if state.get("state") in ENDED else None

    return wait_for(final_state, what=f"{node_dir} ending", timeout=timeout, interval=0.5)


def host_train_args(data: str = "build") -> tuple[str, ...]:
    """`fab train` with CPU ranks on the host's own Python, the data stage as `--data` says."""
    return ("train", "--gpus", "0", "--runtime", "host", "--data", data)


def launch_run(
    fab: FabRunner, sshd, root: Path, *args: str, env: dict | None = None
) -> LaunchedRun:
    result = fab(
        *host_train_args(),
        *args,
        hosts=sshd.address,
        key=sshd.client_key,
        env=env,
    )
    return LaunchedRun(fab, sshd, root, result)


@pytest.fixture(scope="session")
def smoke_run(project, sshd, tmp_path_factory) -> LaunchedRun:
    """`fab train --gpus 0 --smoke --runtime host`, run to its end. Its training part is also the
    uninterrupted reference of the RUN_SETS shape (--smoke's own settings are overridden)."""
    base = tmp_path_factory.mktemp("smoke-run")
    fab = make_fab(project, base / "home", base / "remote", sshd)
    run = launch_run(fab, sshd, base / "remote", "--smoke", *set_args(RUN_SETS))
    final = run.wait_finished()
    assert final["state"] == "finished", (run.node_dir / "train.log").read_text()[-4000:]
    return run


@pytest.fixture
def webhook():
    """A webhook receiver on 127.0.0.1 recording what it is sent (tests/support/webhooks.py)."""
    server = WebhookServer()
    server.start()
    yield server
    server.stop()
