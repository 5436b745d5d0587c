"""A stack whose one worker is this machine behind the tests' real sshd, and runs laid out on it as
`fab train` lays them out: what `make down`'s guard looks at."""

from __future__ import annotations

import os
from pathlib import Path

from clipforge.launcher.host.stored_checkpoints import RUN_ROOTS_FILE
from tests.support.records import run_record


def stack_outputs(sshd, checkpoints_volume: Path) -> dict:
    """`pulumi stack output --json` of a one-worker stack: the worker is 127.0.0.1 through sshd,
    its retained checkpoints volume a directory here."""
    return {
        "released": False,
        "namespace": "clipforge",
        "gpus_per_worker": 4,
        "workers": [{"pod": "clipforge-worker-0", "host": "127.0.0.1"}],
        "ssh": {
            "user": sshd.user,
            "port": sshd.port,
            "entry_pod": "clipforge-worker-0",
            "host_public_key": sshd.host_public_key,
        },
        "volumes": {"checkpoints": {"mount_path": str(checkpoints_volume), "retained": True}},
    }


def worker_home(sshd) -> Path:
    """HOME of the sessions the tests' sshd opens (tests/support/sshd.py)."""
    return Path(sshd.client_key).parent / "home"


def write_run(root: Path, run: str, step: int, *, shared: bool = False) -> Path:
    """A run of `fab train` under a run root: its checkout's checkpoints/ (or, multi-node, the
    run's shared checkpoints/ named in run.json), one training run with `latest` naming step N."""
    run_dir = root / "runs" / run
    checkpoints = run_dir / "checkpoints" if shared else run_dir / "node-0" / "code" / "checkpoints"
    (run_dir / "node-0" / "code").mkdir(parents=True, exist_ok=True)
    if shared:
        (run_dir / "run.json").write_text(run_record(checkpoints_dir=str(checkpoints)).to_json())
    tag_dir = checkpoints / "run-0123456789ab" / f"step-{step:08d}"
    (tag_dir / "global_step").mkdir(parents=True)
    (tag_dir / "global_step" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(2048))
    (tag_dir / "zero_to_fp32.py").write_text(f"# step {step}\n")
    (tag_dir.parent / "latest").write_text(tag_dir.name)
    return tag_dir


def record_root(sshd, root: Path) -> None:
    """As a launch does: the run root noted in the worker's list."""
    roots = worker_home(sshd) / RUN_ROOTS_FILE
    roots.parent.mkdir(parents=True, exist_ok=True)
    with open(roots, "a") as f:
        f.write(f"{root}\n")


def forget_roots(sshd) -> None:
    (worker_home(sshd) / RUN_ROOTS_FILE).unlink(missing_ok=True)
