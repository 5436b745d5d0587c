"""The SSH backend (SshHosts): a launch on hosts reached over SSH, one supervisor per node.

A launch on hosts reached over SSH, the -H hosts or the stack's
workers, one supervisor per node (clipforge.launcher.launch), with a recovery controller on a
spare host when `--spare` is given (clipforge.launcher.controller)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

from fabric import Config

from clipforge.launcher import controller as controller_mod
from clipforge.launcher import launch as launch_mod
from clipforge.launcher import session
from clipforge.launcher.backend import LaunchBackend
from clipforge.launcher.connection import HostSpec
from clipforge.launcher.launch import Prepared
from clipforge.launcher.options import TrainOptions
from clipforge.launcher.run_source import HostRun, RunSource
from clipforge.launcher.session import Host, Settings
from clipforge.launcher.stack import StackOutputs


@dataclass(frozen=True)
class Failover:
    """`fab train --spare`: where a run moves when a training host is gone, and who decides."""

    spare: str | None = None
    controller: str | None = None
    controller_key: str | None = None
    max_moves: int = 0


class SshHosts(LaunchBackend):
    def __init__(
        self,
        hosts: list[HostSpec],
        config: Config,
        settings: Settings,
        say: Callable[[str], None],
        *,
        accept_new_host_key: bool = False,
        failover: Failover | None = None,
    ):
        self.hosts = hosts  # -H, in order (position = node rank); empty: the stack's workers
        self.config = config
        self.settings = settings
        self.say = say
        self.accept_new_host_key = accept_new_host_key
        self.failover = failover or Failover()
        self.specs, self.stack = session.host_specs(hosts, settings)

    @property
    def default_gpus(self) -> int | None:
        return self.stack.gpus_per_worker if self.stack else None

    @functools.cached_property
    def _opened(self) -> tuple[list[Host], StackOutputs | None]:
        """Every host, connected (for a launch that exists: resume, move, status)."""
        return session.open_hosts(self.hosts, self.config, self.settings, self.accept_new_host_key)

    def launch(self, prepared: Prepared, options: TrainOptions) -> str:
        chosen = launch_mod.select_nodes(self.specs, options, from_stack=self.stack is not None)
        hosts = [
            session.open_host(s, self.config, self.settings, self.stack, self.accept_new_host_key)
            for s in chosen
        ]
        recovery = controller_mod.open_recovery(
            spare=self.failover.spare,
            controller=self.failover.controller,
            controller_key=self.failover.controller_key,
            max_moves=self.failover.max_moves,
            hosts=hosts,
            from_stack=self.stack is not None,
            options=options,
            store=prepared.store,
            config=self.config,
            settings=self.settings,
            accept_new_host_key=self.accept_new_host_key,
        )
        launch_id = launch_mod.launch(hosts, prepared, options, self.settings, self.stack, self.say)
        if recovery:
            assert prepared.store is not None  # open_recovery refuses --spare without one
            try:
                controller_mod.start(
                    recovery,
                    hosts,
                    launch_id,
                    prepared.store,
                    prepared.source,
                    self.settings,
                    self.say,
                )
            except BaseException:  # a run nobody watches is not what --spare asked for
                launch_mod.stop_nodes(
                    [(h, session.node_layout(h, i, launch_id)) for i, h in enumerate(hosts)],
                    self.settings,
                )
                raise
        self.say(
            f"started run {launch_id} on {', '.join(h.label for h in hosts)}"
            + (" (smoke)" if options.smoke else "")
        )
        for line in watch_lines(session.fab_command(sys.argv)):
            self.say(line)
        return launch_id

    def resume(self, launch_id: str, store: str | None) -> None:
        hosts, _ = self._opened
        if not launch_mod.has_run(hosts[0], launch_id):
            self.move(launch_id, store)
            return
        layouts = [session.node_layout(h, i, launch_id) for i, h in enumerate(hosts)]
        launch_mod.resume(hosts, layouts, self.settings, self.say)

    def move(self, launch_id: str, store: str | None) -> None:
        hosts, stack = self._opened
        launch_mod.move(hosts, launch_id, store, self.settings, stack, self.say)

    def status(self, launch_id: str | None, store: str | None) -> RunSource:
        hosts, stack = self._opened
        return HostRun.on(hosts, launch_id, self.settings, stack)


def watch_lines(fab: str) -> list[str]:
    """How to watch and stop a run just started, one command a line (`fab`: with the user's -H
    and -i), to be copied whole."""
    return [
        f"watch it:  {fab} status --watch",
        f"           {fab} logs --follow",
        f"           {fab} tensorboard",
        f"stop it:   {fab} stop",
    ]
