"""The train stage end to end on CPU: DeepSpeed, checkpoints, TensorBoard, metrics, export."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading

import pytest
from safetensors.torch import load_file

from tests.conftest import run_train, subprocess_env, train_argv, write_params
from tests.support.wait import still_running, wait_for

pytestmark = pytest.mark.slow


def test_run_writes_checkpoints_keeping_the_last_k_with_an_atomic_latest(reference_run):
    (run_dir,) = (reference_run / "checkpoints").iterdir()
    assert run_dir.name.startswith("run-")
    tags = sorted(p.name for p in run_dir.iterdir() if p.is_dir())
    assert tags == ["step-00000008", "step-00000012"]  # keep_checkpoints: 2
    assert (run_dir / "latest").read_text().strip() == "step-00000012"
    saved_config = (run_dir / "step-00000012" / "config.yaml").read_text()
    assert "global_batch_size: 32" in saved_config
    ds_config = json.loads((run_dir / "deepspeed_config.json").read_text())
    assert (
        ds_config["train_batch_size"],
        ds_config["train_micro_batch_size_per_gpu"],
        ds_config["gradient_accumulation_steps"],
    ) == (32, 16, 2)


def test_tensorboard_events_hold_every_training_scalar(reference_run):
    """Read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log_dir,) = (reference_run / "logs").iterdir()
    events = EventAccumulator(str(log_dir)).Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/logit_scale",
        "perf/samples_per_s",
        "perf/step_s",
        "perf/data_wait_s",
        "val/loss",
    } <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8, 10, 12]
    assert [e.step for e in events.Scalars("val/loss")] == [6, 12]
    assert "alerts/run_started/text_summary" in events.Tags()["tensors"]


def test_tensorboard_names_the_run_and_records_its_hyperparameters(reference_run):
    """The run's name in TensorBoard says model, batch, lr and ZeRO stage before the run id, and
    its hparams table gets the resolved values (the batch split, the steps) and which scalars
    to compare runs by."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    (log_dir,) = (reference_run / "logs").iterdir()
    (run_dir,) = (reference_run / "checkpoints").iterdir()
    assert log_dir.name == f"clipforge-tiny-b32-lr0.001-zero1-{run_dir.name}"
    events = EventAccumulator(str(log_dir)).Reload()
    contents = events.PluginTagToContent("hparams")
    parsed = [plugin_data_pb2.HParamsPluginData.FromString(c) for c in contents.values()]
    start = next(p.session_start_info for p in parsed if p.HasField("session_start_info"))
    values = {k: v.number_value or v.string_value for k, v in start.hparams.items()}
    assert values["lr"] == pytest.approx(1e-3) and values["global_batch_size"] == 32
    assert (values["micro_batch_size"], values["grad_accum_steps"]) == (16, 2)
    assert values["total_steps"] == 12 and values["model"] == "clipforge-tiny"
    experiment = next(p.experiment for p in parsed if p.HasField("experiment"))
    assert {m.name.tag for m in experiment.metric_infos} >= {"val/loss", "val/mean_recall"}


def test_validation_curves_are_a_tsv_like_tensorboard(reference_run):
    """metrics/val.tsv: one row per validation (epoch ends), val loss and recall as in
    TensorBoard, for `dvc plots`; every row names the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = (reference_run / "metrics" / "val.tsv").read_text().splitlines()
    header, rows = (
        lines[0].split("\t"),
        [dict(zip(lines[0].split("\t"), line.split("\t"))) for line in lines[1:]],
    )
    assert header[:2] == ["step", "loss"] and "t2i_r01" in header and "mean_recall" in header
    assert [int(r["step"]) for r in rows] == [6, 12]
    (log_dir,) = (reference_run / "logs").iterdir()
    events = EventAccumulator(str(log_dir)).Reload()
    for name in ("loss", "t2i_r01", "mean_recall"):
        tb = [e.value for e in events.Scalars(f"val/{name}")]
        assert [float(r[name]) for r in rows] == pytest.approx(tb, rel=1e-5)
    (run_dir,) = (reference_run / "checkpoints").iterdir()
    assert {r["run_id"] for r in rows} == {run_dir.name}


def test_metrics_tsv_matches_tensorboard_and_loss_goes_down(reference_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [
        line.split("\t")
        for line in (reference_run / "metrics" / "train.tsv").read_text().splitlines()
    ]
    header, rows = rows[0], rows[1:]
    assert header[:3] == ["step", "epoch", "loss"]
    (log_dir,) = (reference_run / "logs").iterdir()
    tb = EventAccumulator(str(log_dir)).Reload().Scalars("train/loss")
    assert [float(r[2]) for r in rows] == pytest.approx([e.value for e in tb], rel=1e-5)
    assert float(rows[-1][2]) < float(rows[0][2])
    summary = json.loads((reference_run / "metrics" / "train.json").read_text())
    assert summary["loss"] == pytest.approx(float(rows[-1][2]), rel=1e-5)
    assert json.loads((reference_run / "metrics" / "train.info.json").read_text())["steps"] == 12


def test_export_is_fp32_open_clip_local_dir_with_capped_temperature(reference_run):
    model_dir = reference_run / "models" / "clip"
    config = json.loads((model_dir / "open_clip_config.json").read_text())
    assert config["model_cfg"]["vision_cfg"]["image_size"] == 32
    assert config["preprocess_cfg"]["size"] == [32, 32]
    weights = load_file(str(model_dir / "open_clip_model.safetensors"))
    assert all(t.dtype.is_floating_point and t.dtype.itemsize == 4 for t in weights.values())
    assert weights["logit_scale"].shape == ()  # open_clip's 0-dim form, not the [1] of training
    assert (model_dir / "clipforge_config.yaml").is_file()


def test_rerun_of_a_finished_run_resumes_at_the_end_and_exports_the_same_model(
    reference_run, small_data, tmp_path
):
    shutil.copytree(reference_run, tmp_path / "run")
    before = load_file(str(reference_run / "models" / "clip" / "open_clip_model.safetensors"))
    assert run_train(tmp_path / "run", small_data) == 0
    after = load_file(str(tmp_path / "run" / "models" / "clip" / "open_clip_model.safetensors"))
    assert all((before[k] == after[k]).all() for k in before)
    summary = json.loads((tmp_path / "run" / "metrics" / "train.json").read_text())
    reference = json.loads((reference_run / "metrics" / "train.json").read_text())
    info = json.loads((tmp_path / "run" / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == 12
    assert (summary["loss"], summary["val_loss"]) == (reference["loss"], reference["val_loss"])


def test_changed_params_start_a_run_of_their_own(reference_run, small_data, tmp_path):
    """A different lr is a different run id: it must not resume the reference run's weights."""
    root = tmp_path / "other"
    root.mkdir()
    shutil.copytree(reference_run / "checkpoints", root / "checkpoints")
    assert (
        run_train(root, small_data, "train.lr=5e-4", "train.max_steps=2", "train.warmup_steps=1")
        == 0
    )
    runs = sorted(p.name for p in (root / "checkpoints").iterdir())
    assert len(runs) == 2
    assert json.loads((root / "metrics" / "train.info.json").read_text())["resumed_from_step"] == 0


def test_missing_data_is_a_clear_error(tmp_path, capsys):
    assert run_train(tmp_path, tmp_path / "no-data") == 2
    assert "run the data stage first" in capsys.readouterr().err


def test_an_auto_micro_batch_is_kept_with_the_run_and_reused_on_resume(
    tmp_path, small_data, caplog
):
    """The micro batch `auto` settled on (on GPUs, the probe's choice) is written beside the
    checkpoints; a rerun reads it back instead of choosing again, so a resumed run keeps the data
    layout of the run it continues."""
    import logging

    caplog.set_level(logging.INFO, logger="clipforge")
    auto = ("train.micro_batch_size=auto", "train.max_steps=2", "train.warmup_steps=1")
    assert run_train(tmp_path, small_data, *auto) == 0
    (run_dir,) = (tmp_path / "checkpoints").iterdir()
    plan = json.loads((run_dir / "batch_plan.json").read_text())
    assert (plan["micro_batch_size"], plan["grad_accum_steps"]) == (32, 1)
    # as if the first start had probed a GPU that fits 8 pairs at once
    plan.update(micro_batch_size=8, grad_accum_steps=4)
    (run_dir / "batch_plan.json").write_text(json.dumps(plan))
    caplog.clear()
    assert run_train(tmp_path, small_data, *auto) == 0
    assert "micro batch 8 (" in caplog.text and "the run's first choice" in caplog.text
    ds_config = json.loads((run_dir / "deepspeed_config.json").read_text())
    assert ds_config["train_micro_batch_size_per_gpu"] == 8
    assert ds_config["gradient_accumulation_steps"] == 4


def test_a_stop_during_the_set_up_ends_it_there_in_one_line(tmp_path, small_data):
    """SIGTERM while the stage sets up (held by the fault hook once the process group is up, so
    the stop cannot come later): the set-up ends at its next point with exit 143 and one line
    saying where, nothing trained or saved; it used to build the model and the engine and train a
    first step before stopping (minutes on a loaded box)."""
    from clipforge.train.stage import EXIT_STOPPED

    params = write_params(tmp_path / "params.yaml")
    stage = subprocess.Popen(
        [sys.executable, "-m", "clipforge.train", *train_argv(tmp_path, small_data, params)],
        env=subprocess_env() | {"CLIPFORGE_FAULTS": "hold_setup"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(stage.stdout), daemon=True)
    reader.start()
    try:
        wait_for(
            lambda: any("holding the set-up" in line for line in lines),
            what="the set-up held",
            check=still_running(stage, lambda: "".join(lines)),
        )
        stage.send_signal(signal.SIGTERM)
        stage.wait(timeout=300)
    finally:
        if stage.poll() is None:
            stage.kill()
    reader.join(timeout=60)
    log = "".join(lines)
    assert stage.returncode == EXIT_STOPPED, log[-3000:]
    stopped = [line for line in lines if "stopped on request" in line]
    assert len(stopped) == 1 and "during the set-up, after the process group" in stopped[0], log
    assert "Traceback" not in log and " step 1/" not in log, log[-3000:]
    assert not list(tmp_path.glob("checkpoints/run-*/step-*")), log[-3000:]
