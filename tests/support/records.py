"""A run record as `fab train` writes one (clipforge.launcher.host.record), for tests that set up
a run directory by hand."""

from __future__ import annotations

import dataclasses

from clipforge.launcher.host.record import RunRecord


def run_record(**changes) -> RunRecord:
    """A one-node CPU run's record; `changes` replace its fields."""
    record = RunRecord(
        launch_id="20261201-120000-0123456789",
        commit="0123456789abcdef0123456789abcdef01234567",
        dirty_paths_not_shipped=(),
        created_at="2026-12-01T12:00:00Z",
        launched_by="me@laptop",
        hosts=("me@box",),
        host="me@box",
        num_nodes=1,
        gpus_per_node=0,
        runtime="host",
        image="clipforge:test",
        data="build",
        smoke=False,
        executor="python -m clipforge.train",
        overrides=(),
        params={"storage": {"remote": None}},
        checkpoints_dir="/runs/20261201-120000-0123456789/node-0/code/checkpoints",
        master=None,
        max_restarts=5,
        env_passed_through=(),
    )
    return dataclasses.replace(record, **changes)
