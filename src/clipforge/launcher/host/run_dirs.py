"""Where a run lives on a host. Shared by the laptop side (building commands) and the host side.

  <root>/current                       id of the newest run launched on this host
  <root>/runs/<run>/run.json           the run record: id, commit, image, hosts, params, commands
  <root>/runs/<run>/params.resolved.yaml
  <root>/runs/<run>/hostfile           multi-node only: DeepSpeed's resource list
  <root>/runs/<run>/checkpoints/       multi-node only: every node's shards (root on shared storage)
  <root>/runs/<run>/gpus/{node-<rank>.json,decision.json}  multi-node GPU runs: each node's usable
                                       GPUs before an attempt, node 0's decision (host.gpus)
  <root>/runs/<run>/node-<rank>/code/  the git checkout at the run's commit: the DVC workspace,
                                       with data/ checkpoints/ logs/ metrics/ models/ inside
  <root>/runs/<run>/node-<rank>/{plan.json,state.json,supervisor.pid,train.log,supervisor.log,stop,
                                smoke.json,tensorboard.pid,tensorboard.log,keeper.pid,keeper.json}
  <root>/runs/<run>/node-<rank>/reaped/<pid>  an orphaned attempt's exit status (host.keeper)
  <root>/runs/<run>/node-<rank>/home/  HOME inside the container (docker runtime)
  <root>/runs/<run>/node-<rank>/progress/rank-<r>.json  each rank's heartbeat (hang watchdog)

Every path of a node is a property of its NodeLayout: nothing else spells these names.
"""

from __future__ import annotations

import argparse
import os
import posixpath
from dataclasses import dataclass

# <root>'s name unless the user names one: in the SSH user's home, or on the stack's checkpoints
# volume (the launcher's session), where `make down`'s guard looks for runs too (infra/).
DEFAULT_ROOT = "clipforge-runs"
CURRENT = "current"
RUNS = "runs"
NODE_PREFIX = "node-"


@dataclass(frozen=True)
class NodeLayout:
    root: str  # absolute path on the host
    launch_id: str  # clipforge.ids: names the run directory
    node_rank: int

    @classmethod
    def of_node_dir(cls, node_dir: str) -> NodeLayout:
        """The layout whose node_dir this is; ValueError unless it reads <root>/runs/<run>/node-<rank>."""
        run_dir, node = posixpath.split(posixpath.normpath(node_dir))
        runs_dir, launch_id = posixpath.split(run_dir)
        root, runs = posixpath.split(runs_dir)
        rank = node[len(NODE_PREFIX) :]
        if runs != RUNS or not launch_id or not node.startswith(NODE_PREFIX) or not rank.isdigit():
            raise ValueError(
                f"{node_dir}: not a node directory of a run "
                f"(<root>/{RUNS}/<run>/{NODE_PREFIX}<rank>)"
            )
        return cls(root=root, launch_id=launch_id, node_rank=int(rank))

    @property
    def run_dir(self) -> str:
        return posixpath.join(runs_dir(self.root), self.launch_id)

    @property
    def node_dir(self) -> str:
        return posixpath.join(self.run_dir, f"{NODE_PREFIX}{self.node_rank}")

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

    def gpu_report(self, node_rank: int | None = None) -> str:
        """Node `node_rank`'s (default: this node's) usable GPUs before an attempt of a phase that
        spans the nodes; on the run's shared storage, where node 0 reads every node's."""
        rank = self.node_rank if node_rank is None else node_rank
        return posixpath.join(self.run_dir, "gpus", f"{NODE_PREFIX}{rank}.json")

    @property
    def gpu_decision(self) -> str:
        """Node 0's decision on those reports: the ranks every node runs next."""
        return posixpath.join(self.run_dir, "gpus", "decision.json")

    def of_node(self, node_rank: int) -> NodeLayout:
        """Another node's layout of the same run (on shared storage, its files are here too)."""
        return NodeLayout(root=self.root, launch_id=self.launch_id, node_rank=node_rank)

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
    def keeper_pid_file(self) -> str:
        return posixpath.join(self.node_dir, "keeper.pid")

    @property
    def keeper_record(self) -> str:
        """What the keeper saw: the supervisors that died, and when (host.keeper)."""
        return posixpath.join(self.node_dir, "keeper.json")

    @property
    def reaped_dir(self) -> str:
        """Exit statuses of the attempts a dead supervisor left, as its keeper reaped them."""
        return posixpath.join(self.node_dir, "reaped")

    @property
    def train_log(self) -> str:
        return posixpath.join(self.node_dir, "train.log")

    @property
    def supervisor_log(self) -> str:
        return posixpath.join(self.node_dir, "supervisor.log")

    @property
    def progress_dir(self) -> str:
        """The ranks' heartbeat files, read by the supervisor's hang watchdog."""
        return posixpath.join(self.node_dir, "progress")

    @property
    def fault_record(self) -> str:
        """A failed attempt's deterministic fault, as its stage recorded it (clipforge.fault_record)."""
        return posixpath.join(self.node_dir, "fault.json")

    @property
    def stop_request(self) -> str:
        return posixpath.join(self.node_dir, "stop")

    @property
    def smoke_result(self) -> str:
        return posixpath.join(self.node_dir, "smoke.json")

    @property
    def tensorboard_pid(self) -> str:
        return posixpath.join(self.node_dir, "tensorboard.pid")

    @property
    def tensorboard_log(self) -> str:
        return posixpath.join(self.node_dir, "tensorboard.log")

    @property
    def home(self) -> str:
        """HOME inside the container (docker runtime): caches survive restarts of the run."""
        return posixpath.join(self.node_dir, "home")

    def output(self, name: str) -> str:
        """metrics, models/clip, logs, checkpoints, data: inside the DVC workspace."""
        return posixpath.join(self.code, name)


def current_marker(root: str) -> str:
    return posixpath.join(root, CURRENT)


def runs_dir(root: str) -> str:
    """One directory per run launched on the host, named by the run's id."""
    return posixpath.join(root, RUNS)


def node_dir_argument(value: str) -> NodeLayout:
    """The NODE_DIR argument of the host-side commands (argparse `type`), the path resolved."""
    try:
        return NodeLayout.of_node_dir(os.path.realpath(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
