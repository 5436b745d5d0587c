"""The recovery controller's shell (clipforge.launcher.controller) against a real sshd on
127.0.0.1, in-process and quick: what a probe of a host reads (SSH, the node's state, its
supervisor process), and the record it writes here and in the run store when it ends. The move
itself, on real hosts, is tests/launcher/test_spare_host.py; `fab train --spare`'s refusals are
at the end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from clipforge.launcher.controller import Controller, ControllerPlan
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.state import RunState, SupervisorState
from clipforge.launcher.recovery import RecoveryRule
from clipforge.launcher.session import Settings
from tests.launcher.conftest import SMALL_SETS, host_train_args, set_args
from tests.support.sshd import free_port

LAUNCH_ID = "20261201-120000-abcdef1234"
RULE = RecoveryRule(
    probe_every_seconds=0.1, gone_after_misses=2, gone_after_seconds=0.2, max_moves=1
)


def _controller(tmp_path, sshd, spares=()) -> tuple[Controller, NodeLayout]:
    directory, root = tmp_path / "controller", tmp_path / "root"
    directory.mkdir()
    (directory / "known_hosts").write_text(sshd.known_hosts_line)
    (directory / "ssh_config").write_text(
        f"Host *\n    UserKnownHostsFile {directory}/known_hosts\n"
    )
    settings = Settings(
        remote_root=str(root), python="python3", stack_outputs=tmp_path / "none.json",
        min_free_gb=1, backoff_seconds=1, backoff_max_seconds=2, stop_timeout_seconds=9,
        shm_size="1g", registry=None,
    )  # fmt: skip
    plan = ControllerPlan(
        launch_id=LAUNCH_ID,
        store=str(tmp_path / "store"),
        controller="elsewhere",
        hosts=[sshd.address],
        roots=[str(root)],
        spares=list(spares),
        key_filename=[str(sshd.client_key)],
        rule=dataclasses.asdict(RULE),
        settings={**dataclasses.asdict(settings), "stack_outputs": str(settings.stack_outputs)},
    )
    (directory / "plan.json").write_text(plan.to_json())
    layout = NodeLayout(root=str(root), launch_id=LAUNCH_ID, node_rank=0)
    return Controller(directory), layout


def _write_state(layout: NodeLayout, state: RunState, **fields) -> None:
    Path(layout.node_dir).mkdir(parents=True)
    Path(layout.state).write_text(
        SupervisorState(state=state, started_at=1.0, max_restarts=5, **fields).to_json()
    )


def _records(tmp_path, layout) -> list[dict]:
    """The record as the controller's directory, the run store and the run's host hold it."""
    return [
        json.loads(p.read_text())
        for p in (
            tmp_path / "controller" / "recovery.json",
            tmp_path / "store" / "launches" / f"{LAUNCH_ID}.recovery.json",
            tmp_path / "root" / "runs" / LAUNCH_ID / "recovery.json",
        )
        if p.exists()
    ]


def test_a_host_whose_supervisor_is_gone_ends_in_run_failed_when_no_spare_is_left(tmp_path, sshd):
    """SSH answers, the state says running, but no supervisor process lives: every probe
    misses; after 2 misses over 0.2 s the host is gone, and with no spare the controller ends
    `run_failed`, the reason in its record, here, in the store and on the host."""
    controller, layout = _controller(tmp_path, sshd)
    _write_state(layout, RunState.RUNNING, supervisor_pid=2**22 + 1)
    assert controller.run() == 1
    records = _records(tmp_path, layout)
    assert len(records) == 3 and records[0] == records[1]
    assert records[0]["state"] == "run_failed"
    assert f"{sshd.address} gone: " in records[0]["reason"]
    assert "its supervisor is not running (state running)" in records[0]["reason"]
    assert records[0]["reason"].endswith("no spare host left")


def test_a_move_to_a_spare_that_cannot_be_reached_is_recorded_and_spends_the_budget(tmp_path, sshd):
    """No state on the host (a miss), a spare where nothing listens: the move fails, is
    recorded as such, and the budget of one move is spent: `run_failed`."""
    spare = f"{sshd.user}@127.0.0.1:{free_port()}"
    controller, layout = _controller(tmp_path, sshd, spares=[spare])
    assert controller.run() == 1
    record = _records(tmp_path, layout)[0]
    (move,) = record["moves"]
    assert (move["from_host"], move["to_host"]) == (sshd.address, spare)
    assert move["outcome"].startswith("failed: ") and "cannot connect" in move["outcome"]
    assert "no supervisor state at" in move["reason"]
    assert record["state"] == "run_failed"
    assert record["reason"].endswith("the move budget is spent (1 of 1 moves)")


def test_a_finished_run_ends_the_watch(tmp_path, sshd):
    controller, layout = _controller(tmp_path, sshd)
    _write_state(layout, RunState.FINISHED)
    assert controller.run() == 0
    assert _records(tmp_path, layout)[0]["state"] == "finished"


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--spare", "SPARE"), "--spare: the run moves through its run store"),
        (("--controller", "SPARE"), "--controller: needs --spare"),
        (
            ("--spare", "HOST", "--set", "storage.remote=/tmp/nowhere"),
            "it is a training host (-H)",
        ),
    ],
)
def test_train_with_a_spare_refuses_what_cannot_work(fab, sshd, remote_root, extra, message):
    """No run store, a controller without spares, a spare that is a training host: one line,
    and nothing started."""
    spare = f"{sshd.user}@localhost:{sshd.port}"  # the same sshd under another name
    args = [arg.replace("SPARE", spare).replace("HOST", sshd.address) for arg in extra]
    result = fab(
        *host_train_args(), *set_args(SMALL_SETS), *args, hosts=sshd.address, key=sshd.client_key
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (remote_root / "runs").exists()
