"""Which hosts a task acts on: -H, or infra/stack-outputs.json (its shape as infra/README.md
documents it); and the status summary's arithmetic (cost, ETA)."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from fabric import Connection

from clipforge.errors import LauncherError
from clipforge.launcher.connection import spec_of, targets
from clipforge.launcher.host.status import summarize
from clipforge.launcher.session import Settings, root_setting
from clipforge.launcher.stack import load_stack_outputs

OUTPUTS = {
    "namespace": "clipforge",
    "kube_context": "gpu",
    "released": False,
    "image": "registry.example/clipforge:tag",
    "num_workers": 2,
    "gpus_per_worker": 4,
    "gpu_resource_name": "nvidia.com/gpu",
    "workers": [
        {
            "pod": "clipforge-worker-0",
            "host": "clipforge-worker-0.clipforge-workers.clipforge.svc.cluster.local",
        },
        {
            "pod": "clipforge-worker-1",
            "host": "clipforge-worker-1.clipforge-workers.clipforge.svc.cluster.local",
        },
    ],
    "ssh": {
        "user": "clipforge",
        "port": 2222,
        "entry_pod": "clipforge-worker-0",
        "host_public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGZhYnJpYy10ZXN0LWtleS0wMTIzNDU2Nzg5YWJj",
    },
    "volumes": {
        "datasets": {"claim": "d", "mount_path": "/workspace/data", "retained": True},
        "checkpoints": {"claim": "c", "mount_path": "/workspace/checkpoints", "retained": True},
        "logs": {"claim": "l", "mount_path": "/workspace/logs", "retained": True},
    },
    "tensorboard": {"service": "clipforge-tensorboard", "port": 6006},
    "cost": {"currency": "USD", "price_per_gpu_hour": "1.85", "gpus": 8, "per_hour": "14.80"},
}


def _write(tmp_path, value) -> object:
    path = tmp_path / "stack-outputs.json"
    path.write_text(json.dumps(value))
    return path


def _settings(tmp_path, **changes) -> Settings:
    values = dict(
        remote_root=None,
        python="python3",
        stack_outputs=tmp_path / "stack-outputs.json",
        min_free_gb=1,
        backoff_seconds=1,
        backoff_max_seconds=2,
        stop_timeout_seconds=9,
        shm_size="16g",
        registry=None,
    )
    values.update(changes)
    return Settings(**values)


def test_stack_workers_become_the_hosts_with_pinned_key_and_jump(tmp_path, monkeypatch):
    """Without -H: every worker, as the stack's ssh user and port, its host key pinned, through
    the port-forwarded entry worker."""
    monkeypatch.delenv("CLIPFORGE_SSH_GATEWAY", raising=False)
    path = _write(tmp_path, OUTPUTS)
    specs, stack = targets([], lambda: load_stack_outputs(path))
    assert [s.host for s in specs] == [w["host"] for w in OUTPUTS["workers"]]
    assert {(s.user, s.port, s.pinned_key) for s in specs} == {
        ("clipforge", 2222, OUTPUTS["ssh"]["host_public_key"])
    }
    assert (specs[0].gateway.host, specs[0].gateway.port) == ("127.0.0.1", 2222)
    assert stack.price_per_gpu_hour == Decimal("1.85") and stack.gpus_per_worker == 4


def test_runs_live_on_the_retained_checkpoints_volume(tmp_path):
    """The default run root of stack workers is on the checkpoints volume (survives make down)."""
    stack = load_stack_outputs(_write(tmp_path, OUTPUTS))
    assert root_setting(_settings(tmp_path), stack) == "/workspace/checkpoints/clipforge-runs"
    assert root_setting(_settings(tmp_path, remote_root="/data/runs"), stack) == "/data/runs"


def test_cli_hosts_win_over_the_stack(tmp_path):
    """-H given: the hosts in their order, user and port as Fabric parsed them; the stack file is
    not even read."""
    cli = [spec_of(Connection(host)) for host in ("me@gpu:2200", "you@gpu-2:2201")]
    specs, stack = targets(cli, lambda: pytest.fail("stack read"))
    assert [(s.host, s.user, s.port) for s in specs] == [
        ("gpu", "me", 2200),
        ("gpu-2", "you", 2201),
    ]
    assert stack is None


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no hosts"),
        ("{not json", "not readable JSON"),
        ({**OUTPUTS, "released": True}, "released"),
        ({**OUTPUTS, "workers": []}, "no workers"),
        ({**OUTPUTS, "ssh": {"user": "clipforge"}}, "ssh.port"),
        ({k: v for k, v in OUTPUTS.items() if k != "gpus_per_worker"}, "gpus_per_worker"),
        ({**OUTPUTS, "cost": {"price_per_gpu_hour": "cheap"}}, "price_per_gpu_hour"),
    ],
)
def test_bad_stack_outputs_say_what_is_wrong(tmp_path, content, message):
    """Missing file, bad JSON, a released stack, a missing key: an error naming it."""
    path = tmp_path / "stack-outputs.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(LauncherError, match=message):
        load_stack_outputs(path)


def _info(**state):
    return {
        "record": {
            "launch_id": "20260101-000000-abcdef12",
            "commit": "c" * 40,
            "runtime": "host",
            "gpus_per_node": 4,
            "num_nodes": 2,
        },
        "state": {
            "state": "running",
            "phase": "train",
            "attempt": 1,
            "restarts": 1,
            "max_restarts": 5,
            "started_at": 1000.0,
            **state,
        },
        "last_row": {
            "step": "250",
            "epoch": "0.5",
            "loss": "3.25",
            "samples_per_s": "4096.0",
            "mfu": "0.412",
            "data_wait_share": "0.031",
            "peak_mem_gb": "61.2",
        },
        "run_ids": ["run-0123456789ab"],
        "recent_step_seconds": [2.0, 2.0, 3.0],
        "total_steps": 1000,
        "steps_per_epoch": 500,
        "latest_checkpoint": None,
        "summary": None,
        "smoke": None,
        "host_time": 1000.0 + 3600,
    }


def test_status_costs_gpu_hours_at_the_price():
    """Cost so far = elapsed hours x GPUs of all nodes x price; per epoch from the step time."""
    rows = dict(summarize(_info(), Decimal("1.50")))
    # 1 h x 8 GPUs x 1.50 = 12.00; an epoch = 500 steps x 2 s = 1000 s -> 8 x 1.50 x 1000/3600
    assert rows["cost"].startswith("12.00 so far (8 GPUs") and "3.33 per epoch" in rows["cost"]
    assert rows["step"] == "250/1000 (epoch 0.50)" and rows["ETA"] == "25m00s"
    assert rows["elapsed"] == "1h00m00s" and rows["restarts"] == "1/5" and rows["loss"] == "3.2500"


def test_status_names_the_launch_and_the_training_run_each_by_its_own_id():
    """The launch id (fab train's) and the run id (the training run's, from its checkpoints) are
    two rows, each under its name; `-` before the run has saved a checkpoint."""
    rows = dict(summarize(_info(), None))
    assert rows["launch"].startswith("20260101-000000-abcdef12 (commit cccccccccc, host runtime")
    assert rows["run"] == "run-0123456789ab"
    assert dict(summarize({**_info(), "run_ids": []}, None))["run"] == "-"


def test_status_shows_the_runs_throughput_figures():
    """samples/s, MFU, data-wait share and peak memory of the last metrics row; `-` for a
    figure the run could not measure (MFU of a device without a known peak)."""
    rows = dict(summarize(_info(), None))
    assert (rows["samples/s"], rows["MFU"], rows["data wait"], rows["peak memory"]) == (
        "4096.0",
        "41.2%",
        "3.1%",
        "61.2 GB",
    )
    info = _info()
    info["last_row"]["mfu"] = ""
    assert dict(summarize(info, None))["MFU"] == "-"


def test_status_without_a_price_says_where_to_give_one():
    """No price from the stack or the option: the cost row says how to give one."""
    rows = dict(summarize(_info(), None))
    assert "--price-per-gpu-hour" in rows["cost"]


def test_status_names_what_a_phase_does_before_its_first_step():
    """Data stage, model build, eval and smoke recheck: the state row says which, and there is
    no ETA outside the training steps."""
    info = _info()
    info["last_row"], info["data_ready"] = None, False
    assert "getting the data" in dict(summarize(info, None))["state"]
    info["data_ready"] = True
    assert "building the model" in dict(summarize(info, None))["state"]
    for phase, words in (("eval", "evaluating"), ("smoke", "smoke recheck")):
        rows = dict(summarize(_info(phase=phase), None))
        assert words in rows["state"] and rows["ETA"] == "-"


def test_status_shows_every_suite_once_eval_wrote_it():
    """The eval phase's metrics/eval.json: the mean over suites first, then a row per suite:
    mean recall and R@1/5/10 in the directions it has, or zero-shot top-1/top-5."""
    info = _info(state="finished", finished_at=1000.0 + 60)
    info["recall"] = {
        "test": {
            "t2i_r01": 9.6667,
            "t2i_r05": 43.833,
            "t2i_r10": 73.5,
            "i2t_r01": 10.0,
            "i2t_r05": 39.333,
            "i2t_r10": 66.333,
            "mean_recall": 40.444,
        },
        "muge": {"t2i_r01": 5.0, "t2i_r05": 20.0, "t2i_r10": 35.0, "mean_recall": 20.0},
        "colour-shape": {"top1": 31.25, "top5": 75.0},
        "mean_over_suites": 30.565,
    }
    rows = dict(summarize(info, None))
    assert rows["eval"] == "mean over 3 suites 30.57"
    assert rows["eval test"] == (
        "mean recall 40.44 (R@1/5/10 text->image 9.7/43.8/73.5, image->text 10.0/39.3/66.3)"
    )
    assert rows["eval muge"] == "mean recall 20.00 (R@1/5/10 text->image 5.0/20.0/35.0)"
    assert rows["eval colour-shape"] == "zero-shot accuracy top-1 31.25, top-5 75.00"
    assert not any(label.startswith("eval") for label in dict(summarize(_info(), None)))
