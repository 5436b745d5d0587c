"""One training run on this rank: set up, train (or resume) to the end, check, export.

Set up from a validated config, train to the end (or resume
there), check the replicas agree, export. The train stage (stage.py) is the shell around it.

The run id fingerprints data, model and training params (checkpoint.run_id): rerunning with the
same params resumes the run from its latest checkpoint, and ends with the same weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from clipforge import envrecord, repeats, util
from clipforge.alerts.monitor import AlertMonitor
from clipforge.checkpoints import resume
from clipforge.checkpoints.access import check_run_state
from clipforge.checkpoints.checkpointer import Checkpointer
from clipforge.checkpoints.lock import Holder, RunLock, lock_run_dir
from clipforge.errors import StageError
from clipforge.export.card import CardFacts
from clipforge.export.local_dir import export_model
from clipforge.fsutil import atomic_write_text, sha256_file
from clipforge.ids import launch_id_of
from clipforge.model.factory import ClipBundle, build_model
from clipforge.model.files import LOCAL_DIR, weights_file
from clipforge.progress import JOINING_PROCESS_GROUP, SetUpProgress, collective_timeout_seconds
from clipforge.store.uploader import (
    StoreSync,
    launch_record,
    open_store,
    start_store_sync,
    take_store_lease,
)
from clipforge.train import loader as train_loader
from clipforge.train import retrieval_grid
from clipforge.train.config import (
    BatchPlan,
    TrainConfig,
    TrainParams,
    batch_plan,
    reshaped_plan,
    run_id,
)
from clipforge.train.dist import DistInfo, device_has_bf16, init_distributed, resolve_device
from clipforge.train.ds_config import (
    deepspeed_bf16,
    deepspeed_config,
    resolve_precision,
    uses_autocast,
)
from clipforge.train.engine import (
    create_engine,
    forward_autocast,
    fp32_state_dict,
    replicas_in_sync,
)
from clipforge.train.faults import faults_from_env
from clipforge.train.flops import flops_per_sample, peak_flops
from clipforge.train.loop import LoopParts, StopFlag, StopRequested, stop_agreed, train_clip
from clipforge.train.loss import make_loss
from clipforge.train.microbatch import PLAN_FILE, plan_record, probe_on_gpu, saved_micro_batch
from clipforge.train.optim import WarmupCosine, lock_towers
from clipforge.train.reporting import PerfMeter, TrainReport, run_label
from clipforge.train.teacher import Teacher, load_teacher
from clipforge.train.validation import validation_metrics

log = logging.getLogger("clipforge.train")


@dataclass
class TrainingRun:
    """Everything one rank trains with, built by `set_up`."""

    config: TrainParams
    paths: dict[str, Path]
    identity: str  # run-<hash>: the checkpoint and log directory name
    dist: DistInfo
    precision: str  # "bf16" or "fp32", resolved for the device
    plan: BatchPlan
    steps_per_epoch: int
    total_steps: int
    bundle: ClipBundle
    engine: object
    checkpointer: Checkpointer
    state: dict | None  # the client state of the checkpoint resumed from
    to_device: Callable
    loader: object  # micro-batches from the resume position on
    val_loader: Callable  # a fresh loader over the validation batches
    report: TrainReport | None  # TensorBoard and the metrics TSVs; rank 0 only
    alerts: AlertMonitor
    sync: StoreSync | None = None  # rank 0, with storage.remote set
    gallery: retrieval_grid.SampleGallery | None = None  # retrieval samples (None: no val split)
    lock: RunLock | None = None  # rank 0: the run directory's writer lock
    teacher: Teacher | None = None  # train.distill_model, frozen on the device

    @property
    def start_step(self) -> int:
        return self.state["step"] if self.state else 0

    @property
    def autocast(self) -> Callable:
        """The context of every forward: bf16 autocast where the weights stay fp32."""
        train = self.config.train
        return forward_autocast(
            self.dist.device, uses_autocast(self.precision, train.zero_stage, train.locks_a_tower)
        )

    @property
    def resumes(self) -> int:
        return self.state.get("resumes", 0) + 1 if self.state else 0

    def save(self, step: int, scalars: dict) -> None:
        space = self.checkpointer.save(
            self.engine,
            step,
            {
                "step": step,
                "run_id": self.identity,
                "resumes": self.resumes,
                "scalars": scalars,
                "config": self.config.to_dict(),
                "batch_plan": dataclasses.asdict(self.plan),
            },
            self.config.to_yaml(),
        )
        for reason, count in self.loader.skipped.counts.items() if self.report else ():
            self.report.writer.add_scalar(f"data/skipped_{reason}", count, step)  # at read time
        if space.low:
            self.alerts.disk_space_low(str(space.path), space.free, space.need)
        if self.sync:
            lag = self.sync.checkpoint_saved(step)
            if self.report:
                self.report.store_lag(step, lag.steps, lag.seconds)

    def validate(self, step: int) -> float | None:
        metrics = validation_metrics(
            self.engine,
            make_loss(self.config.train.loss, rank=0, world_size=1),
            self.val_loader(),
            self.to_device,
            self.dist.device,
            self.config.train.val_retrieval_samples,
            self.autocast,
        )
        if self.report and metrics:
            self.report.validation(step, metrics)
        self.alerts.check_validation(step, metrics.get("mean_recall"))
        if self.gallery is not None:  # every rank encodes it; rank 0 draws
            found = retrieval_grid.rankings(
                self.engine, self.gallery, self.to_device, self.autocast
            )
            if self.report:
                self.report.retrieval_samples(step, *retrieval_grid.render(self.gallery, *found))
        return metrics.get("loss")


def run_training(
    config: TrainParams,
    paths: dict[str, Path],
    manifest: bytes,
    setup: SetUpProgress | None = None,
) -> dict:
    """Set up everything, train to the end (or resume to it), export. Returns final scalars.
    `setup` beats at each part of set-up, for the supervisor's hang watchdog."""
    device = resolve_device(config.train.device)
    stop = StopFlag()
    stop.install()  # before the slow set-up, so an early SIGTERM is not lost
    setup = setup or SetUpProgress(None, config.alerts.setup_budget_seconds)
    try:
        run = set_up(config, paths, manifest, device, stop, setup)
    except BaseException:  # a failed or stopped set-up: the caller's handlers come back
        stop.uninstall()
        raise
    outcome = "failed"
    try:
        final = train_and_export(run, stop)
        outcome = "finished"
        return final
    except StopRequested:
        outcome = "stopped"
        raise
    finally:
        if run.report:
            run.report.texts(run.alerts.drain_events())
            run.report.close()
        if run.sync:  # the last checkpoint and the logs, up to storage.flush_timeout_seconds
            run.sync.finish(outcome, _final_outputs(paths) if outcome == "finished" else [])
        if run.lock:
            run.lock.release()
        stop.uninstall()


def set_up(
    config: TrainParams,
    paths: dict[str, Path],
    manifest: bytes,
    device: str,
    stop: StopFlag,
    setup: SetUpProgress,
) -> TrainingRun:
    """Process group, model, engine (resumed from the latest checkpoint), data, report, alerts."""
    setup.part(JOINING_PROCESS_GROUP)
    # A collective waiting longer than the stall timeout waits on a dead or cut-off peer: it fails
    # then (and the supervisor restarts or gives up) instead of hanging on for torch's default;
    # under the supervisor's hang watchdog, which acts first, at twice that (progress.py).
    dist = init_distributed(
        device,
        timeout_seconds=collective_timeout_seconds(config.alerts.stall_timeout_seconds),
        stop_requested=lambda: stop.requested,
    )
    faults_from_env().set_up_point(lambda: stop.requested)
    _stop_if_asked(stop, device, "the process group")
    # a rerun (`fab rerun`) is a training run of its own: never the repeated run's checkpoints
    identity = run_id(
        config,
        manifest,
        rerun_launch=repeats.rerun_launch(launch_record()),
        weights_sha256=weights_sha256(config),
    )
    run_dir = paths["checkpoints"] / identity
    # the alert targets (a malformed webhook is a one-line error) before anything is written
    alerts = _alert_monitor(config, identity, dist)  # set-up may report a damaged checkpoint
    # One writer per run, before anything is built or written: a second trainer of the same run
    # stops here in one line. Rank 0 holds it for the run's ranks.
    holder = Holder.this_process()
    setup.part(f"taking the writer lock of {run_dir}")
    lock = _agreed_on(lambda: _checked_and_locked(run_dir, holder), dist.is_main)
    try:
        return _set_up_locked(
            config, paths, device, dist, identity, alerts, holder, lock, stop, setup
        )
    except BaseException:
        if lock:
            lock.abandon()
        raise


def _set_up_locked(
    config: TrainParams,
    paths: dict[str, Path],
    device: str,
    dist: DistInfo,
    identity: str,
    alerts: AlertMonitor,
    holder: Holder,
    lock: RunLock | None,
    stop: StopFlag,
    setup: SetUpProgress,
) -> TrainingRun:
    train = config.train
    run_dir = paths["checkpoints"] / identity
    precision = resolve_precision(train.precision, device, device_has_bf16(device))
    torch.manual_seed(train.seed)
    setup.part("building the model")
    bundle = build_model(config.model, train.loss)
    _lock_towers(bundle, train)
    _stop_if_asked(stop, device, "the model")
    if train.grad_checkpointing:
        bundle.model.set_grad_checkpointing(True)
    # before the micro batch probe, which measures the teacher's weights and forward too
    setup.part("loading the distillation teacher")
    teacher = load_teacher(
        train, bundle, config.model.name, _rank_device(device, dist.local_rank), precision
    )
    _stop_if_asked(stop, device, "the teacher")
    setup.part("settling the batch plan")
    plan = _batch_plan(train, dist, bundle, run_dir, precision, teacher)
    _stop_if_asked(stop, device, "the micro batch")
    files = train_loader.split_files(paths["data"], "train")
    steps_per_epoch = util.steps_per_epoch(files.num_samples, plan.global_batch_size)
    total_steps = util.total_steps(train.max_steps, train.epochs, steps_per_epoch)
    setup.part("opening the run store")
    store = open_store(config.storage, identity) if dist.is_main else None
    lease_taken = take_store_lease(store, holder) if store else False
    setup.part("building the DeepSpeed engine")
    engine, checkpointer = _engine_and_checkpointer(
        train,
        plan,
        device,
        precision,
        bundle,
        run_dir,
        total_steps,
        dist.is_main,
    )
    _stop_if_asked(stop, device, "DeepSpeed's engine")
    setup.part("loading the checkpoint")
    resume.agree_on_start(
        checkpointer, store.checkpoints if store else None, alerts.checkpoint_damaged
    )
    state = checkpointer.load(engine)
    _stop_if_asked(stop, device, "the checkpoint")
    start_step = state["step"] if state else 0
    # a disk without room for the next save fails now, not then
    checkpointer.check_space(engine, start_step)
    log.info(
        "%s %s at step %d/%d (%d steps/epoch), batch %d = %d micro x %d accum x %d ranks, "
        "%s %s ZeRO-%d",
        "resuming" if state else "starting",
        identity,
        start_step,
        total_steps,
        steps_per_epoch,
        plan.global_batch_size,
        plan.micro_batch_size,
        plan.grad_accum_steps,
        plan.world_size,
        device,
        precision,
        train.zero_stage,
    )
    if train.decode_on_device:
        train_loader.check_decode_on_device(device)
        transform, mean, std = train_loader.device_decode_transform(bundle.preprocess_train)
    else:
        transform, mean, std = train_loader.uint8_transform(bundle.preprocess_train)
    setup.part("opening the data")
    tokens = train_loader.stored_tokens(paths["data"], files, bundle.tokenizer, config.model)
    dataset = train_loader.MicroBatches(
        files,
        plan,
        dist.rank,
        train.seed,
        total_steps,
        transform,
        bundle.tokenizer,
        train.shuffle_window_shards,
        tokens,
    )
    label = run_label(
        config.model.name, plan.global_batch_size, train.lr, train.zero_stage, identity
    )
    sync = (
        start_store_sync(
            config.storage,
            config.to_dict(),
            store,
            checkpointer,
            alerts,
            paths,
            label,
            start_step,
            holder,
            lease_taken,
            faults_from_env().after_first_uploaded_file,
        )
        if store
        else None
    )
    prefetch = _prefetch_factor(train, bundle)
    return TrainingRun(
        config=config,
        paths=paths,
        identity=identity,
        dist=dist,
        precision=precision,
        plan=plan,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        bundle=bundle,
        engine=engine,
        checkpointer=checkpointer,
        state=state,
        to_device=_device_batches(mean, std, device, precision, dist.local_rank, transform),
        loader=train_loader.micro_batch_loader(
            dataset,
            start_step * plan.grad_accum_steps,
            train.num_workers,
            pin_memory=device == "cuda",
            prefetch_factor=prefetch,
        ),
        val_loader=_validation_loader(paths["data"], plan, dist, train, bundle, prefetch, tokens),
        report=_report(config, plan, paths, label, identity, start_step, total_steps)
        if dist.is_main
        else None,
        alerts=alerts,
        sync=sync,
        gallery=retrieval_grid.load_gallery(
            paths["data"], train_loader.uint8_transform(bundle.preprocess_val)[0], bundle.tokenizer
        ),
        lock=lock,
        teacher=teacher,
    )


def _rank_device(device: str, local_rank: int) -> torch.device:
    """This rank's device: its GPU, or the CPU."""
    return torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")


def train_and_export(run: TrainingRun, stop: StopFlag) -> dict:
    """Train from the start step to the end; on rank 0, export the model and the summary."""
    parts = LoopParts(
        engine=run.engine,
        loss_fn=make_loss(
            run.config.train.loss,
            run.dist.rank,
            run.dist.world_size,
            run.config.train.distill_weight if run.teacher else None,
        ),
        batches=iter(run.loader),
        to_device=run.to_device,
        report=run.report,
        alerts=run.alerts,
        save=run.save,
        validate=run.validate,
        device=run.dist.device,
        stop=stop,
        perf=_perf_meter(run),
        autocast=run.autocast,
        faults=faults_from_env(),
        teacher=run.teacher,
    )
    began = time.monotonic()
    with run.alerts:  # starts the stall watchdog now that set-up is over; reports a crash
        run.alerts.run_started(
            {
                "steps": run.total_steps,
                "start_step": run.start_step,
                "host": socket.gethostname(),
                "world_size": run.plan.world_size,
                "device": run.dist.device,
            }
        )
        # A start at the final step (the smoke recheck's reload, a rerun of a finished run)
        # trains nothing: an expected reload, no restart to warn about.
        if run.state and run.start_step < run.total_steps:
            run.alerts.run_restarted(run.resumes, from_step=run.start_step)
        final = _train(run, parts)
        _check_replicas(run)
        if run.dist.is_main:
            perf = parts.perf.run() if run.total_steps > run.start_step else {}
            summary = _export(run, final, round(time.monotonic() - began, 1), perf)
            run.alerts.run_finished({k: summary[k] for k in ("steps", "loss", "val_loss")})
    return final


def _batch_plan(
    train: TrainConfig,
    dist: DistInfo,
    bundle: ClipBundle,
    run_dir: Path,
    precision: str,
    teacher: Teacher | None,
) -> BatchPlan:
    """The batch arithmetic, with the micro batch of `auto` settled once per run: probed on GPUs
    at the run's first start, then read back from the run directory on every resume (the same
    micro batch gives the same data layout, so the resumed run ends with the same weights)."""
    micro, how = None, "set in the params"
    if train.micro_batch_size == "auto" and train.grad_accum_steps == "auto":
        how = "the rank's share of the global batch"
        saved = _agreed((saved_micro_batch(run_dir) or 0) if dist.is_main else 0, max)
        if saved:
            micro, how = saved, f"{run_dir / PLAN_FILE}, the run's first choice"
        elif dist.device == "cuda":
            probed = _probe(train, dist, bundle, precision, teacher)
            micro, how = _agreed(probed, min), "memory probe"
    planned_world = train.num_nodes * train.ranks_per_node
    ranks_now = util.ranks_per_node_now(train.ranks_per_node)
    if dist.world_size != train.num_nodes * ranks_now:
        now = "" if ranks_now == train.ranks_per_node else f" ({util.RANKS_NOW_ENV}={ranks_now})"
        raise StageError(
            f"world size {dist.world_size} (from the launcher) != train.num_nodes="
            f"{train.num_nodes} x train.ranks_per_node={train.ranks_per_node}{now}"
        )
    # On fewer ranks than planned (GPUs lost): the planned batch, reshaped to the ranks left, so
    # the global batch, and with it every step's maths, stays the run's.
    plan = batch_plan(train, world_size=planned_world, micro_batch_size=micro)
    if dist.world_size != planned_world:
        plan = reshaped_plan(plan, dist.world_size)
        how += f", kept from the planned {planned_world} ranks"
    log.info(
        "micro batch %d (%s), accumulation %d", plan.micro_batch_size, how, plan.grad_accum_steps
    )
    if dist.is_main and not (run_dir / PLAN_FILE).is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        record = plan_record(plan.micro_batch_size, plan.grad_accum_steps, plan.world_size, how)
        atomic_write_text(run_dir / PLAN_FILE, record)
    return plan


def _probe(
    train: TrainConfig, dist: DistInfo, bundle: ClipBundle, precision: str, teacher: Teacher | None
) -> int:
    return probe_on_gpu(
        bundle.model,
        bundle.model_cfg,
        torch.device("cuda", dist.local_rank),
        train.global_batch_size // dist.world_size,
        dist.world_size,
        deepspeed_bf16(precision, train.zero_stage, train.locks_a_tower),
        forward_autocast("cuda", uses_autocast(precision, train.zero_stage, train.locks_a_tower)),
        teacher,
    )


def weights_sha256(config: TrainParams) -> dict[str, str]:
    """The content of each weights file the run starts from (`start`: model.pretrained) or
    learns from (`teacher`: a local-dir: teacher, or distill_pretrained's file), a second or so
    per GB at each start: part of the run id. An open_clip tag or a hub model names no file
    here and is left out."""
    files = {}
    if config.model.pretrained:
        files["start"] = weights_file(config.model.pretrained, "model.pretrained")
    teacher, teacher_file = config.train.distill_model, config.train.distill_pretrained
    if teacher and teacher.startswith(LOCAL_DIR):
        files["teacher"] = weights_file(teacher, "train.distill_model")
    elif teacher and teacher_file and Path(teacher_file).is_file():
        files["teacher"] = Path(teacher_file)
    return {role: sha256_file(path) for role, path in files.items()}


def _lock_towers(bundle: ClipBundle, train: TrainConfig) -> None:
    """train.lock_*, applied to the model before the micro batch probe (which trains what the
    run trains) and the engine (whose optimizer takes only what trains)."""
    if not train.locks_a_tower:
        return
    locked = lock_towers(bundle.model, train)
    total = sum(p.numel() for p in bundle.model.parameters())
    log.info(
        "towers locked: %d image and %d text parameters of %d; %d train",
        locked["image"],
        locked["text"],
        total,
        sum(p.numel() for p in bundle.model.parameters() if p.requires_grad),
    )


def _stop_if_asked(stop: StopFlag, device: str, after: str) -> None:
    """A SIGTERM/SIGINT during the set-up ends it at the next of these points, after the step
    `after` (each takes seconds, minutes on a loaded box), on every rank at once; it used to wait
    for the whole set-up and a first training step."""
    if stop_agreed(stop, device):
        raise StopRequested(0, during=f"the set-up, after {after}")


def _checked_and_locked(run_dir: Path, holder: Holder) -> RunLock:
    """The run directory's lock, once every file the start reads or locks there is known to be
    readable (one line naming the first that is not, and nothing moved)."""
    check_run_state(run_dir)
    return lock_run_dir(run_dir, holder)


def _agreed_on(take: Callable[[], RunLock], is_main: bool) -> RunLock | None:
    """Rank 0 takes the lock; a refusal stops every rank with rank 0's line (the others would
    wait for it in the next collective)."""
    import torch.distributed as torch_dist

    lock, error = None, None
    if is_main:
        try:
            lock = take()
        except StageError as exc:  # its type too: the supervisor's record names the kind
            error = exc
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        shared = [error]
        torch_dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        if lock:
            lock.release()
        raise error.with_traceback(None) from None
    return lock


def _agreed(value: int, how: Callable) -> int:
    """`how` (min or max) of an integer over all ranks, the same on every rank."""
    import torch.distributed as torch_dist

    if torch_dist.get_world_size() == 1:
        return value
    values = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(values, value)
    return how(values)


def _engine_and_checkpointer(
    train: TrainConfig,
    plan: BatchPlan,
    device: str,
    precision: str,
    bundle: ClipBundle,
    run_dir: Path,
    total_steps: int,
    is_main: bool,
) -> tuple[object, Checkpointer]:
    """The DeepSpeed engine and the run's checkpointer (its DeepSpeed config written beside the
    checkpoints, for inspection; what to resume from is clipforge.checkpoints.resume's to decide)."""
    ds_config = deepspeed_config(train, plan, device, precision)
    engine = create_engine(
        bundle.model,
        ds_config,
        WarmupCosine(train.warmup_steps, total_steps, train.min_lr_ratio),
        train.weight_decay,
        compile_model=train.compile,
    )
    checkpointer = Checkpointer(run_dir, train.keep_checkpoints, is_main)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "deepspeed_config.json", json.dumps(ds_config, indent=2) + "\n")
    return engine, checkpointer


def _device_batches(
    mean, std, device: str, precision: str, local_rank: int, transform=None
) -> train_loader.DeviceBatches:
    """uint8 chunks -> normalised micro-batches on the device, in the weights' dtype (bf16 where
    DeepSpeed keeps bf16 weights; fp32 weights under autocast get fp32 inputs)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    decode = transform if isinstance(transform, train_loader.DeviceCrop) else None
    return train_loader.DeviceBatches(mean, std, _rank_device(device, local_rank), dtype, decode)


def _prefetch_factor(train: TrainConfig, bundle: ClipBundle) -> int:
    """Chunks per loader worker held in /dev/shm, checked against its free space before any
    worker starts: a clear error instead of a bus error mid-run."""
    chunk = train_loader.chunk_bytes(
        bundle.model_cfg["vision_cfg"]["image_size"],
        bundle.model_cfg["text_cfg"].get("context_length", 77),
    )
    return train_loader.prefetch_factor(
        chunk, train.num_workers, train.ranks_per_node, shutil.disk_usage("/dev/shm").free
    )


def _validation_loader(
    data_dir: Path,
    plan: BatchPlan,
    dist: DistInfo,
    train: TrainConfig,
    bundle: ClipBundle,
    prefetch: int,
    tokens: train_loader.TokenFormat | None,
) -> Callable:
    """A factory of loaders over fixed validation batches, an equal number per rank (ZeRO-3
    needs the same number of forward passes on every rank)."""
    files = train_loader.split_files(data_dir, "val")
    if files.num_samples == 0:
        log.info("no validation split in %s: validation loss is not computed", data_dir)
        return lambda: []
    per_step = plan.micro_batch_size * plan.world_size
    val_plan = BatchPlan(per_step, plan.micro_batch_size, 1, plan.world_size)
    steps = files.num_samples // per_step
    if steps == 0:  # a tiny val split: one smaller batch per rank rather than none
        micro = max(1, files.num_samples // plan.world_size)
        val_plan, steps = BatchPlan(micro * plan.world_size, micro, 1, plan.world_size), 1
    transform = train_loader.uint8_transform(bundle.preprocess_val)[0]
    dataset = train_loader.MicroBatches(
        files,
        val_plan,
        dist.rank,
        train.seed,
        steps,
        transform,
        bundle.tokenizer,
        train.shuffle_window_shards,
        tokens,
    )
    return lambda: train_loader.micro_batch_loader(
        dataset, 0, train.num_workers, dist.device == "cuda", prefetch
    )


def _report(
    config: TrainParams,
    plan: BatchPlan,
    paths: dict[str, Path],
    label: str,
    identity: str,
    start_step: int,
    total_steps: int,
) -> TrainReport:
    """TensorBoard under a name that says what the run is (`label`); its hyperparameters in the
    hparams table (once, when the run starts: a resumed run keeps them)."""
    train = config.train
    report = TrainReport(paths["logs"] / label, paths["metrics"], identity, start_step, total_steps)
    if not start_step:
        report.hparams(
            {
                "model": config.model.name,
                "text_tower": config.model.text_tower or "",
                "global_batch_size": plan.global_batch_size,
                "micro_batch_size": plan.micro_batch_size,
                "grad_accum_steps": plan.grad_accum_steps,
                "world_size": plan.world_size,
                "lr": train.lr,
                "warmup_steps": train.warmup_steps,
                "total_steps": total_steps,
                "weight_decay": train.weight_decay,
                "zero_stage": train.zero_stage,
                "precision": train.precision,
                "lock_image": train.lock_image,
                "lock_text": train.lock_text,
                "seed": train.seed,
            }
        )
    return report


def _alert_monitor(config: TrainParams, identity: str, dist: DistInfo) -> AlertMonitor:
    """Alerts name the training run and, when `fab train` started it, the launch."""
    launch = launch_record()
    return AlertMonitor.from_environment(
        config.alerts,
        identity,
        rank=dist.rank,
        local_rank=dist.local_rank,
        launch_id=launch_id_of(launch) if launch else None,
    )


def _train(run: TrainingRun, parts: LoopParts) -> dict:
    try:
        final = train_clip(
            parts, run.config.train, run.plan, run.start_step, run.total_steps, run.steps_per_epoch
        )
    except StopRequested as stopped:
        run.alerts.run_stopped(stopped.step)
        raise
    # a rerun of a finished run takes no step: its results are the checkpoint's
    return final or (run.state or {}).get("scalars", {})


def _check_replicas(run: TrainingRun) -> None:
    drift = replicas_in_sync(run.engine)
    if drift:
        raise RuntimeError(
            f"ranks hold different weights after training (max difference "
            f"{drift:g}): the run is not data-parallel; do not use it"
        )
    if run.plan.world_size > 1 and run.dist.is_main:
        log.info("replicas in sync across %d ranks", run.plan.world_size)


def _final_outputs(paths: dict[str, Path]) -> list[tuple[Path, str]]:
    """What the run store gets at the end of a finished run, besides the logs."""
    return [
        (paths["metrics"] / "train.json", "metrics/train.json"),
        (paths["metrics"] / "train.info.json", "metrics/train.info.json"),
        (paths["model"], "models/clip"),
    ]


def _perf_meter(run: TrainingRun) -> PerfMeter:
    """MFU's inputs: FLOPs from the model config, the peak of this rank's device (rank 0 only:
    it alone reports, and on CPU the peak is measured)."""
    train = run.config.train
    return PerfMeter(
        run.plan.global_batch_size,
        flops_per_sample(
            run.bundle.model_cfg,
            image_trains=not (train.lock_image and not train.lock_image_unlocked_groups),
            text_trains=not (train.lock_text and not train.lock_text_unlocked_layers),
        ),
        peak_flops(run.dist.device, run.precision) if run.dist.is_main else None,
        run.plan.world_size,
        run.dist.device,
    )


def _export(run: TrainingRun, final: dict, wall_seconds: float, perf: dict) -> dict:
    """The fp32 model in open_clip's local-dir layout (with its transformers folder and model
    card), metrics/train.json and train.info.json."""
    state_dict = fp32_state_dict(
        run.checkpointer.run_dir, run.checkpointer.latest_tag(), run.config.train.max_logit_scale
    )
    # train.json: what compares models (dvc metrics show lists every key); train.info.json: the
    # run's bookkeeping.
    metrics = {k: final.get(k) for k in ("loss", "val_loss", "logit_scale")}
    info = {
        "run_id": run.identity,
        "steps": run.total_steps,
        "resumed_from_step": run.start_step,
        "samples_seen": run.total_steps * run.plan.global_batch_size,
        "wall_seconds": wall_seconds,
        "final_lr": final.get("lr"),
        "skipped_at_read": run.loader.skipped.to_dict(),  # corrupt samples replaced, this process
        # this process's steps (a resumed run: those after the resume)
        **{k: perf.get(k) for k in ("samples_per_s", "mfu", "peak_mem_gb", "data_wait_share")},
        envrecord.RESULT_KEY: _environment(run).to_dict(),
        # the manifest itself: what `fab rerun` checks the data against, shard by shard
        "data_manifest": json.loads((run.paths["data"] / "manifest.json").read_bytes()),
    }
    export_model(
        state_dict,
        run.bundle.model_cfg,
        run.bundle.preprocess_cfg,
        run.config.to_yaml(),
        run.paths["model"],
        tokenizer=run.bundle.tokenizer,
        card=_card_facts(run, metrics, info),
    )
    atomic_write_text(run.paths["metrics"] / "train.json", json.dumps(metrics, indent=2) + "\n")
    atomic_write_text(run.paths["metrics"] / "train.info.json", json.dumps(info, indent=2) + "\n")
    log.info("exported %s; final loss %s", run.paths["model"], final.get("loss"))
    return {**metrics, **info}


def _environment(run: TrainingRun) -> envrecord.EnvRecord:
    """This process's environment record, with the run's seeds and batch plan."""
    return envrecord.gather(
        "train stage",
        params_text=run.config.to_yaml(),
        data_manifest=run.paths["data"] / "manifest.json",
        plan={
            "seed": run.config.train.seed,
            **dataclasses.asdict(run.plan),
        },
    )


def _card_facts(run: TrainingRun, metrics: dict, info: dict) -> CardFacts:
    manifest_file = run.paths["data"] / "manifest.json"
    manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    model = run.config.model
    return CardFacts(
        model=model.name + (f" + {model.text_tower}" if model.text_tower else ""),
        run_id=run.identity,
        steps=info["steps"],
        samples_seen=info["samples_seen"],
        data_manifest_sha256=sha256_file(manifest_file),
        decontamination=manifest.get("decontamination"),
        train_metrics=metrics,
        environment=info[envrecord.RESULT_KEY],
        launch_id=launch_id_of(launch) if (launch := launch_record()) else None,
    )
