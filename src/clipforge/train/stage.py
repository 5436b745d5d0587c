"""`python -m clipforge.train`: data/ -> checkpoints/, models/clip/, logs/, metrics/.

The thin shell of the stage: arguments, params, input checks, the relaunch under DeepSpeed's
launcher, exit codes. The run itself is train/run.py. Always on DeepSpeed, world size 1 on a
laptop included. With train.ranks_per_node > 1 and no launcher around it, the stage re-executes
itself under DeepSpeed's launcher.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from clipforge import envrecord, repeats, util
from clipforge.alerts.rules import NonFiniteTrainingError
from clipforge.checkpoints.disk import not_writable_message
from clipforge.cli import load_stage_config, path_argument, run_stage, stage_parser
from clipforge.errors import AccessDenied, StackMismatch, StageError
from clipforge.model.files import check_model_weights, weights_file
from clipforge.model.names import check_text_tower
from clipforge.progress import SetUpProgress
from clipforge.store.remote import RUN_RECORD_ENV, open_filesystem
from clipforge.train.config import TrainParams, check_one_global_batch
from clipforge.train.dist import free_port, resolve_device, under_launcher

log = logging.getLogger("clipforge.train")

EXIT_STOPPED = 143  # 128 + SIGTERM: stopped on request with a checkpoint saved; rerun resumes
# What this stage reads of params.yaml (dvc.yaml's params: its sections).
PARAMS = TrainParams


def _paths(args) -> dict[str, Path]:
    return {
        "data": Path(args.data),
        "checkpoints": Path(args.checkpoints),
        "model": Path(args.model_out),
        "logs": Path(args.logs),
        "metrics": Path(args.metrics),
    }


def _check_inputs(config: TrainParams, paths: dict[str, Path]) -> bytes:
    """Everything that needs no model, checked before the training stack is imported: the data
    stage's output, the batch against the data, the model's text tower, initial weights, writable
    output folders."""
    manifest = paths["data"] / "manifest.json"
    if not manifest.is_file():
        raise StageError(
            f"{manifest} not found: run the data stage first (`dvc repro data` or "
            f"`python -m clipforge.data`)"
        )
    if config.train.num_nodes > 1 and "WORLD_SIZE" not in os.environ:
        raise StageError(
            "train.num_nodes > 1: start one launcher per node (`fab train --nodes N`, "
            "or DeepSpeed's launcher with a hostfile); this command runs one node"
        )
    raw = manifest.read_bytes()
    repeated = _repeated()
    if repeated:  # a rerun trains on the data of the run it repeats, or not at all
        repeats.check_data(repeated, manifest, raw)
    num_train = _checked_shards(manifest, raw)
    check_one_global_batch(num_train, config.train.global_batch_size)
    per_epoch = util.steps_per_epoch(num_train, config.train.global_batch_size)
    _check_warmup(config, util.total_steps(config.train.max_steps, config.train.epochs, per_epoch))
    check_text_tower(config.model)
    if config.model.pretrained:
        weights_file(config.model.pretrained, "model.pretrained")
    if config.train.distill_model:
        check_model_weights(
            config.train.distill_model, config.train.distill_pretrained, "train.distill_model"
        )
    for key in ("checkpoints", "logs", "metrics", "model"):
        problem = not_writable_message(paths[key])
        if problem:
            raise AccessDenied(problem)
    if config.storage.remote:  # the library of its protocol (s3fs...); reaching it is not needed
        open_filesystem(config.storage.remote)  # StoreError (a UserError) when it is missing
    return raw


def _repeated() -> repeats.Repeats | None:
    """The run this launch repeats (`fab rerun`: its run record's `repeats`), if any."""
    path = os.environ.get(RUN_RECORD_ENV)
    return repeats.of_record(repeats.read_record(path), path or "run.json")


def _check_stack() -> None:
    """A rerun's stack against the repeated run's, once torch is imported (its CUDA, cuDNN and
    NCCL are known then): refused, or with --allow-stack-change each difference logged."""
    repeated = _repeated()
    if repeated:
        current = dataclasses.asdict(envrecord.stack())
        for change in repeats.check_stack(repeated, current):
            log.warning("stack changed since run %s: %s; results may differ", repeated.run, change)


def _check_warmup(config: TrainParams, total_steps: int) -> None:
    """A warm-up longer than the run never reaches train.lr: said, with the peak it does reach
    (the last step's warm-up share, as WarmupCosine gives it)."""
    train = config.train
    if train.warmup_steps > total_steps:
        peak = train.lr * total_steps / train.warmup_steps
        log.warning(
            "train.warmup_steps=%d is longer than the run's %d steps: the learning rate peaks "
            "at %.3g, not train.lr=%g; lower train.warmup_steps to train at train.lr",
            train.warmup_steps,
            total_steps,
            peak,
            train.lr,
        )


def _checked_shards(manifest: Path, raw: bytes) -> int:
    """Training samples the manifest lists, after checking every shard it lists is there."""
    try:
        splits = json.loads(raw)["splits"]
        names = [shard["name"] for split in ("train", "val") for shard in splits[split]["shards"]]
        num_train = sum(int(shard["count"]) for shard in splits["train"]["shards"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StageError(
            f"{manifest}: not a data stage manifest ({type(exc).__name__}: {exc}); rerun the data "
            f"stage"
        ) from None
    missing = [name for name in names if not (manifest.parent / name).is_file()]
    if missing:
        raise StageError(
            f"{manifest.parent / missing[0]} not found ({len(missing)} of the shards "
            f"{manifest.name} lists are missing): rerun the data stage, or `dvc checkout data`"
        )
    return num_train


def relaunch_under_deepspeed(config: TrainParams, argv: Sequence[str], ranks: int) -> int:
    """Re-run this stage as `ranks` ranks with DeepSpeed's own launcher (no home-made spawning).
    Fewer than train.ranks_per_node (its supervisor found GPUs lost) on GPUs: the ones it left
    visible (CUDA_VISIBLE_DEVICES), named to the launcher, which would take the first N."""
    device = resolve_device(config.train.device)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "cuda" and visible and ranks < config.train.ranks_per_node:
        which = ["--include", f"localhost:{visible}"]
    else:
        which = ["--num_gpus", str(ranks)]
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        *which,
        "--master_port",
        str(free_port()),
        "--no_local_rank",
        "--module",
        "clipforge.train",
        *argv,
    ]
    env = dict(os.environ)
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"  # the launcher would otherwise probe for GPUs itself
    log.info("launching %d ranks: %s", ranks, " ".join(command))
    return subprocess.call(command, env=env)


def _run(args) -> None:
    config = load_stage_config(args, PARAMS)
    paths = _paths(args)
    manifest = _check_inputs(config, paths)
    ranks = util.ranks_per_node_now(config.train.ranks_per_node)
    if ranks > 1 and not under_launcher():
        code = relaunch_under_deepspeed(config, args.argv, ranks)
        if code:
            raise SystemExit(code)
        return
    # From here on a rank silent for alerts.setup_timeout_seconds is a hang to the supervisor.
    setup = SetUpProgress.from_environment(config.alerts.setup_budget_seconds)
    setup.part("importing the training stack")
    # The run imports DeepSpeed, open_clip and the rest of the training stack (seconds): only
    # once the params and inputs are known to be good, so a bad value fails at once; the
    # relaunching parent above never needs them.
    try:
        from clipforge.train.loop import StopRequested
        from clipforge.train.run import run_training
    except KeyboardInterrupt:  # the supervisor's stop is SIGINT: before the StopFlag, one line
        log.warning("stopped on request before training started; rerun the stage to resume")
        raise SystemExit(EXIT_STOPPED) from None
    except ImportError as exc:
        if (exc.name or "").split(".")[0] == "clipforge":  # our own code: a bug, its traceback
            raise
        raise StackMismatch(
            f"the training stack cannot be imported here ({type(exc).__name__}: {exc}); install "
            f"the pinned stack (`pip install -e .`, or run in the image: `fab train --runtime "
            f"docker`)"
        ) from None

    _check_stack()
    try:
        run_training(config, paths, manifest, setup)
    except StopRequested as stopped:
        log.warning("%s", stopped)
        raise SystemExit(EXIT_STOPPED) from None
    except NonFiniteTrainingError as exc:  # restarting would fail the same way: a user error
        raise StageError(f"training diverged: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = stage_parser("clipforge.train", "Train CLIP with DeepSpeed on the shards in data/.")
    parser.add_argument(
        "--data", type=path_argument, default="data", help="data stage output (default: data)"
    )
    parser.add_argument(
        "--checkpoints", type=path_argument, default="checkpoints", help="default: checkpoints"
    )
    parser.add_argument(
        "--model-out",
        type=path_argument,
        default="models/clip",
        help="export dir (default: models/clip)",
    )
    parser.add_argument(
        "--logs", type=path_argument, default="logs", help="TensorBoard root (default: logs)"
    )
    parser.add_argument(
        "--metrics", type=path_argument, default="metrics", help="metrics dir (default: metrics)"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    parser.set_defaults(argv=argv)
    return run_stage("clipforge.train", _run, argv, parser, PARAMS)
