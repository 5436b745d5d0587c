"""`fab status`: what a run is doing, read on the host, summarised on the laptop.

Host side (`python -m clipforge.launcher.host.status NODE_DIR` prints JSON): the run record, the
supervisor's state (and whether it is really alive), the last row of metrics/train.tsv, the latest
checkpoint, the run store's progress (sync.json, clipforge.store.uploader), the final summary and
smoke result when there are. Laptop side: `summarize` turns that
into step/total, ETA, elapsed and cost.

Only this run's own metrics count. The shipped checkout may hold metrics of another run (a user's
committed results): the rows and the summary are kept only when their run id is one this launch
trained, i.e. names a run directory in this launch's own checkpoints directory (which no commit
holds: checkpoints/ is never committed, and the train stage creates it before its first row).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import time
from decimal import Decimal
from pathlib import Path, PurePosixPath

from clipforge.checkpoints.layout import tag_step
from clipforge.ids import launch_id_of, run_ids_in
from clipforge.launcher.host.keeper import read_keeper_record
from clipforge.launcher.host.processes import attempt_running, keeper_pid, supervisor_pid
from clipforge.launcher.host.record import RunRecord, RunRecordError, read_record
from clipforge.launcher.host.run_dirs import NodeLayout, node_dir_argument
from clipforge.launcher.host.state import (
    RunState,
    StateFileError,
    SupervisorState,
    read_state,
    state_from_dict,
)
from clipforge.launcher.host.supervisor import read_json
from clipforge.store.sync_state import (
    SYNC_STATE_FILE,
    SyncState,
    SyncStateError,
    read_sync_state,
    sync_state_from_dict,
)
from clipforge.util import format_duration, steps_per_epoch, total_steps

RECENT_ROWS = 10


# -- host side -----------------------------------------------------------------------------------
def collect(layout: NodeLayout) -> dict:
    record_error = state_error = None
    try:
        record = read_record(layout.record)
    except RunRecordError as exc:
        record, record_error = None, str(exc)
    try:
        state = read_state(layout.state)
    except StateFileError as exc:
        state, state_error = None, str(exc)
    alive = supervisor_pid(layout) is not None
    trainer = None
    if state and not state.state.terminal and not alive:
        # the supervisor died without saying so (host reboot, kill -9); its attempt may run on
        state = dataclasses.replace(state, state=RunState.LOST)
        trainer = state.child_pid if attempt_running(state.child_pid, layout) else None
    manifest = Path(layout.output("data/manifest.json"))
    checkpoints = Path(record.checkpoints_dir if record else layout.output("checkpoints"))
    own = set(run_ids_in(checkpoints))
    rows = [
        r for r in _tsv_rows(Path(layout.output("metrics/train.tsv"))) if r.get("run_id") in own
    ]
    params = record.params if record else {}
    return {
        "record": _record_summary(record, layout) if record else {},
        "record_error": record_error,
        "run_ids": sorted(own),
        "state": state.to_dict() if state else {},
        "state_error": state_error,
        "supervisor_alive": alive,
        "keeper_pid": keeper_pid(layout),
        "supervisors_replaced": read_keeper_record(layout).get("replaced") or [],
        "attempt_alive": trainer,
        "last_row": rows[-1] if rows else None,
        "recent_step_seconds": [float(r["step_s"]) for r in rows[-RECENT_ROWS:] if r.get("step_s")],
        "total_steps": _total_steps(params, manifest),
        "steps_per_epoch": _steps_per_epoch(params, manifest),
        "latest_checkpoint": _latest_checkpoint(checkpoints),
        **_sync_state(checkpoints),
        "summary": _own_summary(layout, own),
        "smoke": read_json(layout.smoke_result),
        "data_ready": manifest.is_file(),
        "recall": _own_recall(layout, state.started_at if state else None),
        "host_time": time.time(),
    }


def _record_summary(record: RunRecord, layout: NodeLayout) -> dict:
    """What the laptop's status shows of the run record (its params stay on the host)."""
    return {
        "launch_id": record.launch_id,
        "commit": record.commit,
        "host": record.host,
        "node_rank": layout.node_rank,
        "num_nodes": record.num_nodes,
        "gpus_per_node": record.gpus_per_node,
        "runtime": record.runtime,
        "smoke": record.smoke,
        "image": record.image,
        "created_at": record.created_at,
        "executor": record.executor,
    }


def _own_summary(layout: NodeLayout, own: set[str]) -> dict | None:
    """The final losses (train.json) and the run's record of itself (train.info.json), once the
    run has written them."""
    info = read_json(layout.output("metrics/train.info.json"))
    if not info or info.get("run_id") not in own:
        return None
    return {**(read_json(layout.output("metrics/train.json")) or {}), **info}


RECALL_KEYS = ("t2i_r01", "t2i_r05", "t2i_r10", "i2t_r01", "i2t_r05", "i2t_r10", "mean_recall")
ACCURACY_KEYS = ("top1", "top5")
MEAN_KEY = "mean_over_suites"  # clipforge.eval.stage's layout: {suite: metrics, MEAN_KEY: x}


def _own_recall(layout: NodeLayout, started: float | None) -> dict | None:
    """metrics/eval.json once this launch's eval phase wrote it (a file written after the
    supervisor started: the checkout, which may hold committed metrics, was made before): each
    suite's metrics and the mean over suites, the model's own (no baseline)."""
    path = Path(layout.output("metrics/eval.json"))
    try:
        if not started or path.stat().st_mtime < started:
            return None
    except FileNotFoundError:
        return None
    metrics = read_json(path) or {}
    keys = (*RECALL_KEYS, *ACCURACY_KEYS)
    suites = {
        name: {k: value[k] for k in keys if k in value}
        for name, value in metrics.items()
        if isinstance(value, dict) and name not in ("baseline", "delta")
    }
    if not suites:
        return None
    return {**suites, **({MEAN_KEY: metrics[MEAN_KEY]} if MEAN_KEY in metrics else {})}


def _tsv_rows(path: Path) -> list[dict]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f, delimiter="\t"))
    except FileNotFoundError:
        return []


def _steps_per_epoch(params: dict, manifest_path: Path) -> int | None:
    """Full global batches of the training split (clipforge.util.steps_per_epoch, as training)."""
    manifest = read_json(manifest_path)
    train = params.get("train") or {}
    if not manifest or not train.get("global_batch_size"):
        return None
    shards = manifest.get("splits", {}).get("train", {}).get("shards", [])
    num_samples = sum(int(s["count"]) for s in shards)
    return steps_per_epoch(num_samples, int(train["global_batch_size"])) or None


def _total_steps(params: dict, manifest_path: Path) -> int | None:
    train = params.get("train") or {}
    if train.get("max_steps"):
        return int(train["max_steps"])
    per_epoch = _steps_per_epoch(params, manifest_path)
    return (
        total_steps(None, int(train["epochs"]), per_epoch)
        if per_epoch and train.get("epochs")
        else None
    )


def _sync_state(checkpoints: Path) -> dict:
    """The run store's progress, by the newest training run's uploader (sync.json): `sync` as
    it is, or `sync_error` saying what is wrong with the file."""
    found = sorted(checkpoints.glob(f"run-*/{SYNC_STATE_FILE}"), key=lambda p: p.stat().st_mtime)
    try:
        sync = read_sync_state(found[-1]) if found else None
    except SyncStateError as exc:
        return {"sync": None, "sync_error": str(exc)}
    return {"sync": sync.to_dict() if sync else None, "sync_error": None}


def _latest_checkpoint(checkpoints: Path) -> str | None:
    """What the newest `latest` marker names; a marker that is not a readable file (a folder, a
    link, another user's) is none: the train stage says what is wrong with it."""
    markers = sorted(
        (p for p in checkpoints.glob("run-*/latest") if p.is_file() and not p.is_symlink()),
        key=lambda p: p.stat().st_mtime,
    )
    for marker in reversed(markers):
        try:
            return str(marker.parent / marker.read_text(encoding="utf-8").strip())
        except (OSError, UnicodeDecodeError):
            continue
    return None


# -- laptop side ---------------------------------------------------------------------------------
def summarize(info: dict, price_per_gpu_hour: Decimal | None) -> list[tuple[str, str]]:
    """(label, value) rows for the status table."""
    record, row = info["record"], info.get("last_row") or {}
    state = state_from_dict(info["state"], "the supervisor's state") if info["state"] else None
    name = state.state if state else None
    total = info.get("total_steps")
    step = last_step(row, state, info.get("latest_checkpoint"))
    if info.get("summary") and name is RunState.FINISHED:
        step = info["summary"].get("steps", step)
    started = state.started_at if state else None
    ended = (state.finished_at if state else None) or info["host_time"]
    elapsed = ended - started if started else None
    seconds_per_step = _median(info.get("recent_step_seconds") or [])
    gpus = (record.get("gpus_per_node") or 0) * (record.get("num_nodes") or 1)
    rows = [
        (
            "launch",
            f"{launch_id_of(record)} (commit {str(record.get('commit'))[:10]}, "
            f"{record.get('runtime')} runtime, {_gpus_text(record)})"
            if record
            else f"unknown: {info.get('record_error') or 'no run record (run.json)'}",
        ),
        # the training run(s) of this launch, by the checkpoints it saved: none until the first
        ("run", ", ".join(info.get("run_ids") or []) or "-"),
        ("state", _state_text(state, info.get("state_error"), info, step)),
        (
            "step",
            f"{step}/{total if total else '?'}"
            + (f" (epoch {float(row['epoch']):.2f})" if row.get("epoch") else ""),
        ),
        ("loss", _loss_text(row, info.get("summary"))),
        ("samples/s", f"{float(row['samples_per_s']):.1f}" if row.get("samples_per_s") else "-"),
        ("MFU", _percent(row.get("mfu"))),
        ("data wait", _percent(row.get("data_wait_share"))),
        ("peak memory", f"{float(row['peak_mem_gb']):.1f} GB" if row.get("peak_mem_gb") else "-"),
        (
            "ETA",
            format_duration(seconds_per_step * (total - step))
            if seconds_per_step
            and total
            and name is RunState.RUNNING
            and state is not None
            and state.phase == "train"
            and step < total
            else "-",
        ),
        ("elapsed", format_duration(elapsed) if elapsed is not None else "-"),
        ("restarts", f"{state.restarts}/{state.max_restarts}" if state else "0/?"),
        *_replaced_rows(info.get("supervisors_replaced") or []),
        *_gpu_rows(state),
        ("checkpoint", info.get("latest_checkpoint") or "none yet"),
    ]
    if info.get("sync"):
        sync = sync_state_from_dict(info["sync"], "the run store's sync state")
        rows.append(("run store", sync_text(sync)))
    elif info.get("sync_error"):
        rows.append(("run store", f"unknown: {info['sync_error']}"))
    rows.append(
        (
            "cost",
            _cost_text(
                elapsed, gpus, price_per_gpu_hour, seconds_per_step, info.get("steps_per_epoch")
            ),
        )
    )
    rows.append(
        ("goodput", _goodput_text(step, seconds_per_step, elapsed, gpus, price_per_gpu_hour))
    )
    if info.get("recall"):
        rows += eval_rows(info["recall"])
    if info.get("smoke"):
        rows.append(
            (
                "smoke",
                "passed"
                if info["smoke"].get("passed")
                else "FAILED: "
                + ", ".join(k for k, ok in info["smoke"]["checks"].items() if not ok),
            )
        )
    return rows


def last_step(row: dict, state: SupervisorState | None, checkpoint: str | None) -> int:
    """The run's last step: its last metrics row, the step its stage said it failed at, or its
    latest checkpoint's, whichever is furthest (the rows may be gone: DVC removes a stage's
    outputs before it runs it)."""
    steps = [int(row["step"]) if row.get("step") else 0]
    if state is not None and state.last_step is not None:
        steps.append(state.last_step)
    if checkpoint:
        steps.append(tag_step(PurePosixPath(checkpoint).name) or 0)
    return max(steps)


def sync_text(sync: SyncState) -> str:
    """The run store's progress (clipforge.store.uploader's state): what it holds, how far behind."""
    step = sync.store_step
    text = (
        f"{sync.store}: step {step if step is not None else 'none yet'}, behind by "
        f"{sync.lag_steps} steps / {format_duration(sync.lag_seconds)}"
    )
    if sync.failures:
        text += f", {sync.failures} failed attempts ({sync.last_error})"
    return text


def _gpu_rows(state: SupervisorState | None) -> list[tuple[str, str]]:
    """A `GPUs` row once the supervisor found one gone (the gpu_lost alert's facts): which, and
    the ranks the run went on with (before -> after), or that it could not."""
    gpus = state.gpus if state else None
    if not gpus:
        return []
    planned, ranks, before = gpus.get("planned"), gpus.get("ranks"), gpus.get("ranks_before")
    if isinstance(gpus.get("nodes"), dict):
        return _nodes_gpu_rows(gpus)
    if not gpus.get("lost"):
        if before is not None and ranks is not None and before != ranks:
            return [
                ("GPUs", f"all {planned} answer again: back to {ranks} ranks ({before} -> {ranks})")
            ]
        return []
    lost = ", ".join(f"GPU {i}" for i in gpus["lost"])
    text = (
        f"lost {lost} of {planned} (found by {gpus.get('source')}); "
        f"{len(gpus.get('usable', []))} answer"
    )
    if ranks:
        devices = ", ".join(f"GPU {i}" for i in gpus.get("devices", []))
        text += f"; going on with {ranks} of {planned} ranks on {devices} ({before} -> {ranks})"
    elif ranks is not None:
        text += f"; below --min-gpus={gpus.get('min_gpus')}: stopped"
    return [("GPUs", text)]


def _nodes_gpu_rows(gpus: dict) -> list[tuple[str, str]]:
    """The `GPUs` row of a multi-node run: which node lost which GPUs, and the ranks every node
    went on with (the supervisors' agreement, clipforge.launcher.host.gpus.agree)."""
    planned, ranks, before = gpus.get("planned"), gpus.get("ranks"), gpus.get("ranks_before")
    short = []
    for rank, node in gpus["nodes"].items():
        usable = node.get("usable", []) if isinstance(node, dict) else []
        lost = [i for i in range(planned or 0) if i not in usable]
        if lost:
            gone = ", ".join(f"GPU {i}" for i in lost)
            short.append(f"node {rank} ({node.get('host')}) lost {gone} of {planned}")
    if not short:
        if before is not None and ranks is not None and before != ranks:
            return [
                (
                    "GPUs",
                    f"all {planned} answer again on every node: back to {ranks} ranks per node "
                    f"({before} -> {ranks})",
                )
            ]
        return []
    text = "; ".join(short)
    if ranks:
        text += f"; every node goes on with {ranks} of {planned} ranks ({before} -> {ranks})"
    elif ranks is not None:
        text += f"; below --min-gpus={gpus.get('min_gpus')} per node: stopped"
    return [("GPUs", text)]


def eval_rows(recall: dict) -> list[tuple[str, str]]:
    """The eval stage's numbers: the mean over suites, then a row per suite (`eval NAME`)."""
    if "mean_recall" in recall:  # a host still on the one-test-set layout
        recall = {"test": recall}
    suites = {k: v for k, v in recall.items() if isinstance(v, dict)}
    rows = []
    if MEAN_KEY in recall:
        rows.append(("eval", f"mean over {len(suites)} suites {recall[MEAN_KEY]:.2f}"))
    for name, metrics in suites.items():
        if "top1" in metrics:
            text = f"top-1 {metrics['top1']:.2f}" + (
                f", top-5 {metrics['top5']:.2f}" if "top5" in metrics else ""
            )
            rows.append((f"eval {name}", f"zero-shot accuracy {text}"))
        else:
            rows.append((f"eval {name}", recall_text(metrics)))
    return rows


def recall_text(recall: dict) -> str:
    """The eval stage's numbers (percent), the mean first: what the run is for."""

    def triple(direction: str) -> str:
        return "/".join(f"{recall[f'{direction}_r{k:02d}']:.1f}" for k in (1, 5, 10))

    text = f"mean recall {recall['mean_recall']:.2f}" if "mean_recall" in recall else ""
    directions = [
        f"{words} {triple(d)}"
        for d, words in (("t2i", "text->image"), ("i2t", "image->text"))
        if all(f"{d}_r{k:02d}" in recall for k in (1, 5, 10))
    ]
    if directions:
        text += f" (R@1/5/10 {', '.join(directions)})"
    return text.strip()


def activity(state: SupervisorState, info: dict) -> str | None:
    """What the running phase is doing, where the step and the speed cannot tell yet."""
    phase = state.phase
    if phase == "train" and info.get("last_row"):
        return None  # the step, loss and speed rows say it
    if phase == "data" or (phase == "train" and not info.get("data_ready")):
        return "getting the data: the data stage or `dvc pull`"
    if phase == "train":
        return "building the model and the DeepSpeed engine; no step logged yet"
    if phase == "eval":
        return "evaluating the exported model on the test set"
    if phase == "smoke":
        return "smoke recheck: reloading the final checkpoint (an expected restart)"
    return None


def _replaced_rows(replaced: list) -> list[tuple[str, str]]:
    """A `supervisor` row once its keeper replaced one (host.keeper): how many, the last one."""
    if not replaced or not isinstance(replaced[-1], dict):
        return []
    last = replaced[-1]
    return [
        (
            "supervisor",
            f"replaced {len(replaced)}x by its keeper; the last, pid {last.get('supervisor_pid')}, "
            f"gone at {_utc(last.get('gone_at'))} ({last.get('how')}), its attempt adopted",
        )
    ]


def _utc(at: object) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
        if isinstance(at, (int, float))
        else "?"
    )


def lost_text(state: SupervisorState, info: dict, step: int) -> str:
    """The state of a node whose supervisor is gone: since when, whether its attempt runs on
    (what it is doing), and what brings a supervisor back (its keeper, or `--resume`, which
    adopts a live attempt rather than racing it)."""
    gone = next(
        (
            r.get("gone_at")
            for r in reversed(info.get("supervisors_replaced") or [])
            if isinstance(r, dict) and r.get("supervisor_pid") == state.supervisor_pid
        ),
        None,
    )
    when = f"at {_utc(gone)}" if gone else f"(last heard from at {_utc(state.updated_at)})"
    text = f"lost: supervisor pid {state.supervisor_pid} gone {when}"
    trainer = info.get("attempt_alive")
    if trainer:
        doing = f"training at step {step}" if state.phase == "train" else f"in phase {state.phase}"
        text += f"; trainer pid {trainer} still {doing}"
    else:
        text += " without finishing; nothing of its attempt runs"
    if info.get("keeper_pid"):
        return text + f"; its keeper (pid {info['keeper_pid']}) is starting a new supervisor"
    adopts = ", which adopts the trainer" if trainer else ""
    return text + f"; `fab train --resume ID` starts a supervisor{adopts}"


def _state_text(state: SupervisorState | None, error: str | None, info: dict, step: int = 0) -> str:
    if state is None:
        return f"damaged: {error}" if error else "unknown"
    if state.state is RunState.RUNNING:
        doing = activity(state, info)
        return f"running (phase {state.phase}, attempt {state.attempt})" + (
            f": {doing}" if doing else ""
        )
    if state.state is RunState.LOST:
        return lost_text(state, info, step)
    if state.state is RunState.FAILED and state.reason:
        return f"failed: {state.reason}"
    return state.state.value


def _percent(cell: str | None) -> str:
    """A share from metrics/train.tsv (blank where not measured) as a percentage."""
    return f"{100 * float(cell):.1f}%" if cell else "-"


def _loss_text(row: dict, summary: dict | None) -> str:
    if summary and summary.get("loss") is not None:
        val = f", val {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else ""
        return f"{summary['loss']:.4f}{val} (final)"
    return f"{float(row['loss']):.4f}" if row.get("loss") else "-"


def _gpus_text(record: dict) -> str:
    gpus, nodes = record.get("gpus_per_node") or 0, record.get("num_nodes") or 1
    where = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "CPU"
    return f"{nodes} node{'s' if nodes != 1 else ''} x {where}"


def _cost_text(
    elapsed: float | None,
    gpus: int,
    price: Decimal | None,
    seconds_per_step: float | None,
    steps_per_epoch: int | None,
) -> str:
    if not gpus:
        return "- (CPU run)"
    if price is None:
        return "- (no price: --price-per-gpu-hour, or the stack's cost.price_per_gpu_hour)"
    per_gpu_second = price / Decimal(3600)
    so_far = per_gpu_second * Decimal(str(round(elapsed or 0))) * gpus
    text = f"{so_far:.2f} so far ({gpus} GPUs x {price}/GPU-hour)"
    if seconds_per_step and steps_per_epoch:
        per_epoch = per_gpu_second * Decimal(str(round(seconds_per_step * steps_per_epoch))) * gpus
        text += f", {per_epoch:.2f} per epoch"
    return text


def goodput(step: int, seconds_per_step: float | None, elapsed: float | None) -> float | None:
    """The share of the run's wall time that went into the steps it kept: steps done x the
    typical step time, over the time since the supervisor started. Set-up, validation,
    checkpoint saves, back-offs, crashed attempts and the steps redone after them (since the
    last checkpoint) are the rest. At most 1 (a run resumed from an earlier launch's checkpoint
    brings steps this launch did not pay for)."""
    if not seconds_per_step or not elapsed or elapsed <= 0:
        return None
    return min(1.0, step * seconds_per_step / elapsed)


def _goodput_text(
    step: int,
    seconds_per_step: float | None,
    elapsed: float | None,
    gpus: int,
    price: Decimal | None,
) -> str:
    share = goodput(step, seconds_per_step, elapsed)
    if share is None:
        return "-"
    assert elapsed is not None  # goodput is None without it
    lost = (1 - share) * elapsed
    text = f"{100 * share:.0f}% of the time trained; {format_duration(lost)} went elsewhere"
    if gpus and price is not None:
        wasted = price / Decimal(3600) * Decimal(str(round(lost))) * gpus
        text += f" ({wasted:.2f} of the cost)"
    return text + " (set-up, validation, saves, restarts and the steps they redid)"


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clipforge.launcher.host.status")
    parser.add_argument("node_dir", type=node_dir_argument, metavar="NODE_DIR")
    print(json.dumps(collect(parser.parse_args(argv).node_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
