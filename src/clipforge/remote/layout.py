"""Where a run lives on a host. Shared by the laptop side (building commands) and the host side.

  <root>/current                       id of the newest run launched on this host
  <root>/runs/<run>/run.json           the run record: id, commit, image, hosts, params, commands
  <root>/runs/<run>/params.resolved.yaml
  <root>/runs/<run>/hostfile           multi-node only: DeepSpeed's resource list
  <root>/runs/<run>/checkpoints/       multi-node only: every node's shards (root on shared storage)
  <root>/runs/<run>/node-<rank>/code/  the git checkout at the run's commit: the DVC workspace,
                                       with data/ checkpoints/ logs/ metrics/ models/ inside
  <root>/runs/<run>/node-<rank>/{plan.json,state.json,supervisor.pid,train.log,supervisor.log,stop}

Standard library only (see clipforge.remote).
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass

CURRENT = "current"


@dataclass(frozen=True)
class NodeLayout:
    root: str  # absolute path on the host
    run_id: str
    node_rank: int

    @property
    def run_dir(self) -> str:
        return posixpath.join(self.root, "runs", self.run_id)

    @property
    def node_dir(self) -> str:
        return posixpath.join(self.run_dir, f"node-{self.node_rank}")

    @property
    def code(self) -> str:
        return posixpath.join(self.node_dir, "code")

    @property
    def record(self) -> str:
        return posixpath.join(self.run_dir, "run.json")

    @property
    def resolved_params(self) -> str:
        return posixpath.join(self.run_dir, "params.resolved.yaml")

    @property
    def hostfile(self) -> str:
        return posixpath.join(self.run_dir, "hostfile")

    @property
    def shared_checkpoints(self) -> str:
        return posixpath.join(self.run_dir, "checkpoints")

    @property
    def plan(self) -> str:
        return posixpath.join(self.node_dir, "plan.json")

    @property
    def state(self) -> str:
        return posixpath.join(self.node_dir, "state.json")

    @property
    def pid_file(self) -> str:
        return posixpath.join(self.node_dir, "supervisor.pid")

    @property
    def train_log(self) -> str:
        return posixpath.join(self.node_dir, "train.log")

    @property
    def supervisor_log(self) -> str:
        return posixpath.join(self.node_dir, "supervisor.log")

    @property
    def stop_request(self) -> str:
        return posixpath.join(self.node_dir, "stop")

    @property
    def home(self) -> str:
        """HOME inside the container (docker runtime): caches survive restarts of the run."""
        return posixpath.join(self.node_dir, "home")

    def output(self, name: str) -> str:
        """metrics, models/clip, logs, checkpoints, data: inside the DVC workspace."""
        return posixpath.join(self.code, name)


def current_marker(root: str) -> str:
    return posixpath.join(root, CURRENT)
