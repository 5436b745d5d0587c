"""One run, one launch: a `fab train` of a run a live launch on the host already trains is refused.

Each launch has its own checkout, so the train stage's writer lock (one per run folder) never
sees a second launch of the same run on a host: both would train it, side by side. The run id
(clipforge.ids) is named by the train stage, from the data manifest that may not exist before
the launch; what names it is known before: the params of `clipforge.train.config.run_identity`
(the model, the train params less the knobs that never change the weights) and where the data
comes from (the `data:` params and `--data`). A launch whose node's keeper, supervisor or trainer
is alive on a host (as clipforge.launcher.host.processes recognises each) is live; a new launch
with the same identity as a live one is refused in one line naming it, before anything is
shipped.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from clipforge.errors import LauncherError
from clipforge.ids import checked_launch_id
from clipforge.launcher.connection import probe, q
from clipforge.launcher.host.processes import SUPERVISOR_MODULE
from clipforge.launcher.host.record import RunRecordError
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.session import Host, read_remote_record
from clipforge.progress import PROGRESS_DIR_ENV
from clipforge.train.config import run_identity

# Per node directory of the root: `<node dir>\t<what> <pid>` when its keeper or supervisor (by
# the pid file and a command line naming its module and the directory) or its attempt (by the state's child_pid
# and an environment naming the node's progress folder) is alive. A zombie has no command line
# and no environment, so it is not alive here.
_LIVE_NODES = r"""
root=$(cd {root} 2>/dev/null && pwd -P) || exit 0
for d in "$root"/runs/*/node-*; do
  [ -d "$d" ] || continue
  live=
  for f in keeper supervisor; do
    p=$(cat "$d/$f.pid" 2>/dev/null)
    case "$p" in ''|*[!0-9]*) continue;; esac
    c=$(tr '\0' '\n' < /proc/$p/cmdline 2>/dev/null)
    if printf '%s\n' "$c" | grep -qxF "$d" && printf '%s\n' "$c" | grep -qxF "{host}.$f"; then
      live="$f $p"; break
    fi
  done
  if [ -z "$live" ]; then
    p=$(sed -n 's/^ *"child_pid": \([0-9][0-9]*\).*/\1/p' "$d/state.json" 2>/dev/null)
    if [ -n "$p" ] && tr '\0' '\n' < /proc/$p/environ 2>/dev/null \
        | grep -qxF "{env}=$d/progress"; then live="trainer $p"; fi
  fi
  [ -z "$live" ] || printf '%s\t%s\n' "$d" "$live"
done
"""


@dataclass(frozen=True)
class LiveNode:
    layout: NodeLayout
    what: str  # keeper, supervisor or trainer
    pid: int


def live_nodes(host: Host) -> list[LiveNode]:
    """The nodes of launches on this host's run root whose keeper, supervisor or trainer runs."""
    result = probe(
        host.cxn,
        _LIVE_NODES.format(
            root=q(host.root), env=PROGRESS_DIR_ENV, host=SUPERVISOR_MODULE.rpartition(".")[0]
        ),
    )
    found = []
    for line in result.stdout.splitlines():
        node_dir, _, live = line.partition("\t")
        what, _, pid = live.partition(" ")
        try:
            layout = NodeLayout.of_node_dir(node_dir)
            checked_launch_id(layout.launch_id, f"{host.label}:{node_dir}")
        except ValueError:
            continue  # not a launch's folder: nothing this launch could race
        # the root as the user gave it, so that the paths read next are the ones they know
        layout = NodeLayout(host.root, layout.launch_id, layout.node_rank)
        found.append(LiveNode(layout, what, int(pid)))
    return found


def identity(params: dict, data: str) -> dict:
    """What names a launch's training run, as far as it is known before the launch."""
    return {**run_identity(params), "data": params.get("data"), "data_source": data}


def refuse_a_second_launch(hosts: list[Host], params: dict, data: str) -> None:
    """LauncherError, in one line naming it, when a live launch on one of `hosts` trains the run
    this launch would (the same identity); nothing is shipped before this."""
    wanted = identity(params, data)
    for host in hosts:
        for node in live_nodes(host):
            try:
                record = read_remote_record(host, node.layout)
            except (LauncherError, RunRecordError):
                continue  # no record to compare with: a launch being shipped, or not ours
            if identity(record.params, record.data) == wanted:
                launch = node.layout.launch_id
                raise LauncherError(
                    f"{host.label}: launch {launch} trains this run already (its {node.what}, "
                    f"pid {node.pid}, runs in {posixpath.dirname(node.layout.node_dir)}, with the "
                    f"same model, train and data params): one run, one launch; see `fab status "
                    f"--launch {launch}`, or `fab stop --launch {launch}` first; nothing was "
                    f"started"
                )
