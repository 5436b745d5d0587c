"""`python -m clipforge.train`: data/ -> checkpoints/, models/clip/, logs/, metrics/.

Always on DeepSpeed, world size 1 on a laptop included. With train.ranks_per_node > 1 and no
launcher around it, the stage re-executes itself under DeepSpeed's launcher.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from clipforge.cli import StageError, load_stage_config, run_stage, stage_parser
from clipforge.config import Config, batch_plan
from clipforge.fsutil import atomic_write_text

log = logging.getLogger("clipforge.train")

EXIT_STOPPED = 143  # 128 + SIGTERM: stopped on request with a checkpoint saved; rerun resumes


def _paths(args) -> dict[str, Path]:
    return {"data": Path(args.data), "checkpoints": Path(args.checkpoints),
            "model": Path(args.model_out), "logs": Path(args.logs), "metrics": Path(args.metrics)}


def _check_inputs(config: Config, paths: dict[str, Path]) -> bytes:
    manifest = paths["data"] / "manifest.json"
    if not manifest.is_file():
        raise StageError(f"{manifest} not found: run the data stage first (`dvc repro data` or "
                         f"`python -m clipforge.data`)")
    if config.train.num_nodes > 1 and "WORLD_SIZE" not in os.environ:
        raise StageError("train.num_nodes > 1: start one launcher per node (`fab train --nodes N`, "
                         "or DeepSpeed's launcher with a hostfile); this command runs one node")
    return manifest.read_bytes()


def relaunch_under_deepspeed(config: Config, argv: Sequence[str]) -> int:
    """Re-run this stage as N ranks with DeepSpeed's own launcher (no home-made spawning)."""
    from clipforge.train.dist import free_port, resolve_device

    command = [sys.executable, "-m", "deepspeed.launcher.runner",
               "--num_gpus", str(config.train.ranks_per_node), "--master_port", str(free_port()),
               "--no_local_rank", "--module", "clipforge.train", *argv]
    env = dict(os.environ)
    if resolve_device(config.train.device) == "cpu":
        env["DS_ACCELERATOR"] = "cpu"  # the launcher would otherwise probe for GPUs itself
    log.info("launching %d ranks: %s", config.train.ranks_per_node, " ".join(command))
    return subprocess.call(command, env=env)


def run_training(config: Config, paths: dict[str, Path], manifest: bytes) -> dict:
    """Set up everything, train to the end (or resume to it), export. Returns final scalars."""
    import torch

    from clipforge.alerts.monitor import AlertMonitor
    from clipforge.model import build_model
    from clipforge.train import data as train_data
    from clipforge.train.checkpoint import Checkpointer, run_id
    from clipforge.train.dist import init_distributed, resolve_device
    from clipforge.train.ds_config import deepspeed_config, resolve_precision
    from clipforge.train.engine import create_engine, replicas_in_sync
    from clipforge.train.faults import faults_from_env
    from clipforge.train.loop import LoopParts, StopFlag, StopRequested, train_clip
    from clipforge.train.loss import make_clip_loss
    from clipforge.train.monitor import TrainMonitor
    from clipforge.train.optim import WarmupCosine

    train = config.train
    device = resolve_device(train.device)
    stop = StopFlag()
    stop.install()  # before the slow set-up, so an early SIGTERM is not lost
    dist_info = init_distributed(device)
    plan = batch_plan(train, world_size=dist_info.world_size)
    if plan.world_size != train.num_nodes * train.ranks_per_node:
        raise StageError(f"world size {plan.world_size} (from the launcher) != train.num_nodes="
                         f"{train.num_nodes} x train.ranks_per_node={train.ranks_per_node}")
    precision = resolve_precision(train.precision, device,
                                  device == "cuda" and torch.cuda.is_bf16_supported())
    torch.manual_seed(train.seed)
    try:
        bundle = build_model(config.model)
    except (ValueError, FileNotFoundError) as exc:
        raise StageError(str(exc)) from None

    files = train_data.split_files(paths["data"], "train")
    try:
        steps_per_epoch = train_data.steps_per_epoch(files.num_samples, plan.global_batch_size)
    except ValueError as exc:
        raise StageError(str(exc)) from None
    total_steps = train.max_steps or train.epochs * steps_per_epoch
    identity = run_id(config, manifest)
    run_dir = paths["checkpoints"] / identity
    ds_config = deepspeed_config(train, plan, device, precision)
    engine = create_engine(bundle.model, ds_config,
                           WarmupCosine(train.warmup_steps, total_steps, train.min_lr_ratio),
                           train.weight_decay)
    checkpointer = Checkpointer(run_dir, train.keep_checkpoints, dist_info.is_main)
    if dist_info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpointer.discard_incomplete()
        atomic_write_text(run_dir / "deepspeed_config.json", json.dumps(ds_config, indent=2) + "\n")
    state = checkpointer.load(engine)
    start_step = state["step"] if state else 0
    log.info("%s %s at step %d/%d (%d steps/epoch), batch %d = %d micro x %d accum x %d ranks, "
             "%s %s ZeRO-%d", "resuming" if state else "starting", identity, start_step, total_steps,
             steps_per_epoch, plan.global_batch_size, plan.micro_batch_size, plan.grad_accum_steps,
             plan.world_size, device, precision, train.zero_stage)

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    target = torch.device(device, dist_info.local_rank) if device == "cuda" else torch.device("cpu")

    def to_device(batch):
        images, texts = batch
        return images.to(target, dtype=dtype, non_blocking=True), texts.to(target, non_blocking=True)

    dataset = train_data.MicroBatches(files, plan, dist_info.rank, train.seed, total_steps,
                                      bundle.preprocess_train, bundle.tokenizer)
    loader = train_data.micro_batch_loader(dataset, start_step * plan.grad_accum_steps,
                                           train.num_workers, pin_memory=device == "cuda")
    val_loader = _validation_loader(paths["data"], plan, dist_info, train, bundle)
    val_loss_fn = make_clip_loss(rank=0, world_size=1)
    config_yaml = config.to_yaml()
    monitor = None
    if dist_info.is_main:
        monitor = TrainMonitor(paths["logs"] / identity, paths["metrics"] / "train.tsv",
                               start_step, total_steps)

    resumes = state.get("resumes", 0) + 1 if state else 0
    try:
        alerts = AlertMonitor.from_environment(config.alerts, identity, rank=dist_info.rank,
                                               local_rank=dist_info.local_rank)
    except ValueError as exc:  # a malformed CLIPFORGE_ALERT_WEBHOOKS entry (never echoed)
        raise StageError(str(exc)) from None

    def save(step: int, scalars: dict) -> None:
        checkpointer.save(engine, step, {"step": step, "run_id": identity, "resumes": resumes,
                                         "scalars": scalars, "config": config.to_dict()},
                          config_yaml)

    def validate(step: int) -> float | None:
        from clipforge.train.validation import validation_metrics

        metrics = validation_metrics(engine, val_loss_fn, val_loader(), to_device, device,
                                     train.val_retrieval_samples)
        if monitor:
            for name, value in metrics.items():  # val/loss, val/t2i_r1, ..., val/mean_recall
                monitor.scalar(f"val/{name}", value, step)
        return metrics.get("loss")

    parts = LoopParts(engine=engine, loss_fn=make_clip_loss(dist_info.rank, dist_info.world_size),
                      batches=iter(loader), to_device=to_device, monitor=monitor, alerts=alerts,
                      save=save, validate=validate, device=device, stop=stop,
                      faults=faults_from_env())
    began = time.monotonic()
    try:
        with alerts:  # starts the stall watchdog now that set-up is over; reports a crash
            alerts.run_started({"steps": total_steps, "start_step": start_step, "host": _host(),
                                "world_size": plan.world_size, "device": device})
            if state:
                alerts.run_restarted(resumes, from_step=start_step)
            try:
                final = train_clip(parts, train, plan, start_step, total_steps, steps_per_epoch)
                # a rerun of a finished run takes no step: its results are the checkpoint's
                final = final or (state or {}).get("scalars", {})
            except StopRequested as stopped:
                alerts.run_stopped(stopped.step)
                raise
            drift = replicas_in_sync(engine)
            if drift:
                raise RuntimeError(f"ranks hold different weights after training (max difference "
                                   f"{drift:g}): the run is not data-parallel; do not use it")
            if plan.world_size > 1 and dist_info.is_main:
                log.info("replicas in sync across %d ranks", plan.world_size)
            if dist_info.is_main:
                summary = _export(run_dir, checkpointer, train, bundle, config_yaml, paths,
                                  {"run_id": identity, "steps": total_steps,
                                   "resumed_from_step": start_step,
                                   "samples_seen": total_steps * plan.global_batch_size,
                                   "wall_seconds": round(time.monotonic() - began, 1)}, final)
                alerts.run_finished({k: summary[k] for k in ("steps", "loss", "val_loss")})
    finally:
        if monitor:
            monitor.texts(alerts.drain_events())
            monitor.close()
        stop.uninstall()
    return final


def _export(run_dir, checkpointer, train, bundle, config_yaml, paths, summary, final) -> dict:
    from clipforge.train.engine import fp32_state_dict
    from clipforge.train.export import export_model

    state_dict = fp32_state_dict(run_dir, checkpointer.latest_tag(), train.max_logit_scale)
    export_model(state_dict, bundle.model_cfg, bundle.preprocess_cfg, config_yaml, paths["model"],
                 tokenizer=bundle.tokenizer)
    summary.update({k: final.get(k) for k in ("loss", "val_loss", "logit_scale", "lr")})
    atomic_write_text(paths["metrics"] / "train.json", json.dumps(summary, indent=2) + "\n")
    log.info("exported %s; final loss %s", paths["model"], final.get("loss"))
    return summary


def _host() -> str:
    import socket

    return socket.gethostname()


def _validation_loader(data_dir: Path, plan, dist_info, train, bundle):
    """A factory of loaders over fixed validation batches, an equal number per rank (ZeRO-3
    needs the same number of forward passes on every rank)."""
    from clipforge.config import BatchPlan
    from clipforge.train import data as train_data

    files = train_data.split_files(data_dir, "val")
    if files.num_samples == 0:
        log.info("no validation split in %s: validation loss is not computed", data_dir)
        return lambda: []
    per_step = plan.micro_batch_size * plan.world_size
    val_plan = BatchPlan(per_step, plan.micro_batch_size, 1, plan.world_size)
    steps = files.num_samples // per_step
    if steps == 0:  # a tiny val split: one smaller batch per rank rather than none
        micro = max(1, files.num_samples // plan.world_size)
        val_plan, steps = BatchPlan(micro * plan.world_size, micro, 1, plan.world_size), 1
    dataset = train_data.MicroBatches(files, val_plan, dist_info.rank, train.seed, steps,
                                      bundle.preprocess_val, bundle.tokenizer)
    return lambda: train_data.micro_batch_loader(dataset, 0, train.num_workers,
                                                 pin_memory=dist_info.device == "cuda")


def _run(args) -> None:
    config = load_stage_config(args)
    paths = _paths(args)
    manifest = _check_inputs(config, paths)
    from clipforge.train.dist import under_launcher

    if config.train.ranks_per_node > 1 and not under_launcher():
        code = relaunch_under_deepspeed(config, args.argv)
        if code:
            raise SystemExit(code)
        return
    from clipforge.alerts.rules import NonFiniteTrainingError
    from clipforge.train.loop import StopRequested

    try:
        run_training(config, paths, manifest)
    except StopRequested as stopped:
        log.warning("%s", stopped)
        raise SystemExit(EXIT_STOPPED) from None
    except NonFiniteTrainingError as exc:  # restarting would fail the same way: a user error
        raise StageError(f"training diverged: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = stage_parser("clipforge.train", "Train CLIP with DeepSpeed on the shards in data/.")
    parser.add_argument("--data", default="data", help="data stage output (default: data)")
    parser.add_argument("--checkpoints", default="checkpoints", help="default: checkpoints")
    parser.add_argument("--model-out", default="models/clip", help="export dir (default: models/clip)")
    parser.add_argument("--logs", default="logs", help="TensorBoard root (default: logs)")
    parser.add_argument("--metrics", default="metrics", help="metrics dir (default: metrics)")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser.set_defaults(argv=argv)
    return run_stage("clipforge.train", _run, argv, parser)
