"""One seam for where a launch runs: SSH hosts or Kubernetes Jobs, behind one interface.

SSH hosts (clipforge.launcher.ssh_hosts.SshHosts: -H, or
the stack's workers) or the stack's cluster as Kubernetes Jobs and JobSets
(clipforge.launcher.kubernetes.KubernetesJobs).

`fab train` and the tasks that read a run where it lives (status, fetch, tensorboard) pick one
and dispatch to it; what a launch is (its commit, params and image: launch.prepare) is the same
for both, and so is how a run is read from its store (run_source.StoredRun).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from clipforge.launcher.launch import Prepared
from clipforge.launcher.options import TrainOptions
from clipforge.launcher.run_source import RunSource


class LaunchBackend(ABC):
    """What `fab` asks of the place a launch runs."""

    @property
    @abstractmethod
    def default_gpus(self) -> int | None:
        """GPUs per node when --gpus is not given (the stack's; None: it must be given)."""

    @abstractmethod
    def launch(self, prepared: Prepared, options: TrainOptions) -> str:
        """Start a new launch of `prepared` and say how to watch it; its launch id. A launch
        that fails leaves nothing running."""

    @abstractmethod
    def resume(self, launch_id: str, store: str | None) -> None:
        """`fab train --resume ID`: start launch `launch_id` again where it is (after `fab
        stop`, a lost supervisor, a spent budget), or `move` it here when it is not."""

    @abstractmethod
    def move(self, launch_id: str, store: str | None) -> None:
        """Start launch `launch_id` here as its run store `store` keeps it (its hosts gone),
        under the same id, from the same commit and options."""

    @abstractmethod
    def status(self, launch_id: str | None, store: str | None) -> RunSource:
        """Where `fab status`, `fab fetch` and `fab tensorboard` read the launch (None: the
        newest where a place knows one)."""
