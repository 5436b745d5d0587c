"""The hosts of one `fab` invocation, connected, each with its run root resolved."""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Optional

from fabric import Connection

from clipforge.remote import hosts as hostmod
from clipforge.remote.errors import RemoteError
from clipforge.remote.layout import NodeLayout, current_marker
from clipforge.remote.settings import Settings
from clipforge.remote.shell import probe, q, run
from clipforge.remote.stack import StackOutputs, load_stack_outputs

DEFAULT_ROOT = "clipforge-runs"  # relative: in the SSH user's home


@dataclass
class Host:
    cxn: Connection
    label: str
    root: str  # absolute path on the host


def host_specs(cli_hosts: list[str], settings: Settings):
    return hostmod.targets(cli_hosts, lambda: load_stack_outputs(settings.stack_outputs))


def root_setting(settings: Settings, stack: Optional[StackOutputs]) -> str:
    if settings.remote_root is not None:
        return settings.remote_root
    if stack and "checkpoints" in stack.mount_paths:
        # Retained storage: the run (code, checkpoints) outlives the worker pods.
        return posixpath.join(stack.mount_paths["checkpoints"], DEFAULT_ROOT)
    return DEFAULT_ROOT


def open_host(spec, config, settings: Settings, stack, accept_new_host_key: bool) -> Host:
    cxn = hostmod.connect(spec, config, accept_new_host_key)
    root = root_setting(settings, stack)
    result = run(cxn, f"mkdir -p {q(root)} && cd {q(root)} && pwd -P", what=f"creating {root}")
    return Host(cxn=cxn, label=hostmod.label(cxn), root=result.stdout.strip())


def open_hosts(cli_hosts: list[str], config, settings: Settings, accept_new_host_key: bool = False):
    specs, stack = host_specs(cli_hosts, settings)
    return [open_host(s, config, settings, stack, accept_new_host_key) for s in specs], stack


def run_id_on(host: Host, requested: Optional[str]) -> str:
    """--run when given, else the newest run launched on this host."""
    if requested:
        if not probe(host.cxn, f"test -d {q(posixpath.join(host.root, 'runs', requested))}").ok:
            raise RemoteError(f"{host.label}: no run {requested} under {host.root}/runs "
                              f"(`fab status` lists the newest; runs are named by --run)")
        return requested
    result = probe(host.cxn, f"cat {q(current_marker(host.root))}")
    if not result.ok or not result.stdout.strip():
        raise RemoteError(f"{host.label}: no run launched under {host.root} yet (`fab train`)")
    return result.stdout.strip()


def node_layout(host: Host, index: int, requested_run: Optional[str]) -> NodeLayout:
    """The node of the run that lives on this host: its position among the hosts is its rank."""
    run_id = run_id_on(host, requested_run)
    layout = NodeLayout(root=host.root, run_id=run_id, node_rank=index)
    if not probe(host.cxn, f"test -d {q(layout.node_dir)}").ok:
        raise RemoteError(f"{host.label}: run {run_id} has no node {index} here (the hosts, in "
                          f"order, must be those it was launched on)")
    return layout


def remote_python(host: Host, settings: Settings, layout: NodeLayout, module: str, *args: str) -> str:
    """A shell command running one of the host-side modules of the run's own code."""
    tail = " ".join(q(a) for a in args)
    return (f"PYTHONPATH={q(posixpath.join(layout.code, 'src'))} {q(settings.python)} -m "
            f"clipforge.remote.{module} {tail}")


def read_remote_json(host: Host, path: str) -> Optional[dict]:
    result = probe(host.cxn, f"cat {q(path)}")
    if not result.ok:
        return None
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        return None
