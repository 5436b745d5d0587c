"""Two CPU ranks under DeepSpeed's launcher: the run completes, ranks stay in sync, and the
contrastive batch spans both ranks (the result matches the single-rank run of the same batch);
a bf16 run of two ranks goes on with one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from clipforge.checkpoints.layout import tag_for
from clipforge.util import RANKS_NOW_ENV
from tests.conftest import BF16_SETS, set_args, subprocess_env, train_argv, write_params
from tests.support.plain_open_clip import plain_open_clip
from tests.support.wait import still_running, wait_for

# Real multi-rank runs (1.5 and 2 minutes on 2 cores): in make test-tier2 (.ci/run). make test keeps
# the bf16 production path end to end at one rank (tests/export/test_export_and_eval.py), its
# exact resume (test_resume.py) and the shrink rule and universal conversion's unit tests
# (test_fewer_ranks.py).
pytestmark = [pytest.mark.slow, pytest.mark.tier2]


def test_two_rank_run_matches_the_single_rank_run(two_rank_run, reference_run):
    """The same global batch on 2 ranks (16 x 1 x 2) as on 1 (16 x 2 x 1): DeepSpeed's launcher
    started both, their replicas agreed, and the run ends with the single rank's loss and weights
    (fp32 round-off: the gradient summed in another order)."""
    output = (two_rank_run / "stage.log").read_text()
    assert "deepspeed.launcher.runner" in output  # relaunched as 2 processes by DeepSpeed
    assert output.count("replicas in sync across 2 ranks") == 1

    summary = json.loads((two_rank_run / "metrics" / "train.json").read_text())
    reference = json.loads((reference_run / "metrics" / "train.json").read_text())
    assert json.loads((two_rank_run / "metrics" / "train.info.json").read_text())["steps"] == 12
    assert summary["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    two = load_file(str(two_rank_run / "models" / "clip" / "open_clip_model.safetensors"))
    one = load_file(str(reference_run / "models" / "clip" / "open_clip_model.safetensors"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-3, atol=1e-4, msg=name)


# global batch 16 = micro 8 x 2 ranks, 4 steps, a checkpoint every 2 (on 1 rank: 8 x 2 accumulated)
SHRINK_SETS = (
    "train.ranks_per_node=2",
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
    "train.max_steps=4",
    "train.save_every_steps=2",
)


def test_a_bf16_two_rank_run_goes_on_with_one_rank_and_its_export_loads(tmp_path, small_data):
    """Fewer GPUs in DeepSpeed's bf16 mode: a 2-rank bf16 ZeRO-1 run killed after its checkpoint
    of step 2 of 4 (as a GPU lost mid-run kills every rank), rerun on 1 rank as the supervisor
    reruns it then (CLIPFORGE_RANKS_PER_NODE=1): the checkpoint of 2 ranks loads through
    DeepSpeed's universal checkpoint, the run ends with the same global batch, and its export loads
    strictly in plain open_clip, in fp32. Half the usual batch: bf16 is slow on this CPU. (The
    supervisor's part, and the step-by-step comparison with an uninterrupted 2-rank run:
    tests/launcher/host/test_fewer_gpus.py, tier2.)"""
    params = write_params(tmp_path / "params.yaml")
    command = [
        sys.executable,
        "-m",
        "clipforge.train",
        *train_argv(tmp_path, small_data, params),
        *set_args((*BF16_SETS, *SHRINK_SETS)),
    ]
    # Step 3 is held until a stop that never comes: the kill lands after the checkpoint of step
    # 2, however fast this machine trains. Its own session: the launcher and both ranks go.
    two_ranks = subprocess.Popen(
        command,
        env={**subprocess_env(), "CLIPFORGE_FAULTS": "hold@3"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    markers = tmp_path / "checkpoints"
    try:
        wait_for(
            lambda: [p.read_text().strip() for p in markers.glob("run-*/latest")] == [tag_for(2)],
            what="the 2-rank run's checkpoint of step 2",
            check=still_running(two_ranks, lambda: two_ranks.stderr.read().decode()[-2000:]),
            interval=0.5,
        )
    finally:
        os.killpg(two_ranks.pid, signal.SIGKILL)
        two_ranks.wait()

    one_rank = subprocess.run(
        command,
        env={**subprocess_env(), RANKS_NOW_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = one_rank.stdout + one_rank.stderr
    assert one_rank.returncode == 0, log[-3000:]
    assert "loading it through DeepSpeed's universal checkpoint" in log
    assert "batch 16 = 8 micro x 2 accum x 1 ranks" in log and "bf16 ZeRO-1" in log
    info = json.loads((tmp_path / "metrics" / "train.info.json").read_text())
    assert (info["resumed_from_step"], info["steps"]) == (2, 4)
    plain = plain_open_clip(tmp_path / "models" / "clip", small_data / "test", tmp_path / "p.json")
    assert plain["dtypes"] == ["torch.float32"]
