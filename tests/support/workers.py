"""Work done in fresh interpreters: a ZeRO-3 engine patches torch.nn.functional.linear for its
whole process, and a process group is one per process. `json_from` runs one and reads back the
JSON it wrote; `on_ranks` is what a worker module's main calls to run on N gloo ranks;
`ranks_of` starts a module as N ranks, each a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO, subprocess_env


def json_from(argv: list[str], out: Path, timeout: float = 600) -> dict:
    """`python ARGV...` from the repository root (a module with `-m`, a script with `-c`), which
    must exit 0 having written `out`: its content."""
    result = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def ranks_of(module: str, world: int, env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """`python -m MODULE` as each of `world` ranks on this machine, started together (RANK,
    LOCAL_RANK and WORLD_SIZE set over `env`): each rank's exit code, stdout and stderr."""
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", module],
            cwd=REPO,
            env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [rank.communicate(timeout=600) for rank in ranks]
    return [
        subprocess.CompletedProcess(rank.args, rank.returncode, out, err)
        for rank, (out, err) in zip(ranks, outputs)
    ]


def on_ranks(run: Callable, world: int, args) -> None:
    """run(rank, world, args) on `world` ranks: this process alone for one, else spawned
    processes meeting on a free port of 127.0.0.1 (run sets RANK/WORLD_SIZE and starts gloo)."""
    if world == 1:
        _run_then_leave(0, run, world, args)
        return
    import torch.multiprocessing as mp

    from clipforge.train.dist import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(_run_then_leave, args=(run, world, args), nprocs=world, join=True)


def _run_then_leave(rank: int, run: Callable, world: int, args) -> None:
    """A rank leaves its process group before it exits, as the train stage's ranks do."""
    from clipforge.train.dist import leave_process_group

    run(rank, world, args)
    leave_process_group()
