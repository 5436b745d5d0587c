"""One run, one launch: a `fab train` of the run a live launch on the host trains already is
refused in one line naming that launch, before anything is shipped. The live launch here is a
real supervisor under its keeper with a shell command for its trainer (seconds), whose run record
holds the params `fab train` resolves for the same command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from clipforge.launcher.host.plan import Phase, PhasePlan, RestartPolicy
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.host.supervisor import MODULE
from clipforge.launcher.live_runs import identity
from clipforge.launcher.options import resolve_params
from tests.conftest import subprocess_env
from tests.launcher.conftest import RUN_SETS, host_train_args, set_args, wait_for_end
from tests.support.records import run_record
from tests.support.wait import wait_for

LIVE = "20260101-000000-0123abcd"


def _params(project: Path, sets: list[str]) -> dict:
    return resolve_params((project / "params.yaml").read_text(), tuple(sets)).to_dict()


def test_a_second_launch_of_a_live_run_is_refused_in_one_line(project, fab, sshd, remote_root):
    node = NodeLayout(str(remote_root), LIVE, 0)
    Path(node.node_dir).mkdir(parents=True)
    record = run_record(launch_id=LIVE, params=_params(project, RUN_SETS), data="build")
    Path(node.record).write_text(record.to_json())
    release = Path(node.node_dir) / "release"
    trainer = Phase(
        name="train",
        argv=["sh", "-c", f"while [ ! -e {release} ]; do sleep 0.1; done"],
        cwd=node.node_dir,
    )
    policy = RestartPolicy(
        max_restarts=0, backoff_seconds=0.1, backoff_max_seconds=0.1, stop_timeout_seconds=10
    )
    Path(node.plan).write_text(PhasePlan(phases=[trainer], policy=policy).to_json())
    started = subprocess.run(
        [sys.executable, "-m", MODULE, "launch", node.node_dir],
        env=subprocess_env(),
        input="{}",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 0, started.stderr
    wait_for(
        lambda: (
            '"state": "running"' in Path(node.state).read_text()
            if Path(node.state).exists()
            else False
        ),
        what="the live launch running",
        timeout=120,
    )
    try:
        second = fab(
            *host_train_args(), *set_args(RUN_SETS), hosts=sshd.address, key=sshd.client_key
        )
        assert second.returncode != 0
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and LIVE in lines[0], second.stderr
        assert "trains this run already (its keeper, pid " in lines[0]
        assert "one run, one launch" in lines[0] and "nothing was started" in lines[0]
        assert [p.name for p in (remote_root / "runs").iterdir()] == [LIVE]  # nothing shipped
    finally:
        release.touch()
    assert wait_for_end(Path(node.node_dir), timeout=120)["state"] == "finished"


def test_what_names_a_run_is_its_model_train_and_data_params_and_data_source(project):
    base = _params(project, RUN_SETS)
    same = identity(base, "build")
    # knobs that only change how often the run writes: the same run
    assert identity(_params(project, [*RUN_SETS, "train.log_every_steps=3"]), "build") == same
    assert identity(_params(project, [*RUN_SETS, "train.seed=7"]), "build") != same
    assert identity(base, "pull") != same
    assert identity(_params(project, [*RUN_SETS, "data.seed=7"]), "build") != same
