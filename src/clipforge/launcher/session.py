"""The launcher's settings, and the connected hosts of one `fab` invocation.

The launcher's settings, and the hosts of one `fab` invocation, connected, each with its run
root resolved.

Settings are Fabric config under `clipforge` (fabric.yaml, or FABRIC_CLIPFORGE_* env). Each is
declared once, in `Settings` (type, range, default, doc); the fabfile's collection config takes
their defaults from it, and docs/launcher.md's table is written from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric import Connection

from clipforge.errors import LauncherError
from clipforge.fields import knob
from clipforge.ids import checked_launch_id
from clipforge.launcher import connection
from clipforge.launcher.commands import DockerSpec, run_container
from clipforge.launcher.connection import RESTRICT_UMASK, HostSpec, join, probe, q, run
from clipforge.launcher.host.plan import RestartTimings
from clipforge.launcher.host.record import RunRecord, parse_record
from clipforge.launcher.host.run_dirs import DEFAULT_ROOT, NodeLayout, current_marker
from clipforge.launcher.host.state import SupervisorState, state_from_dict
from clipforge.launcher.recovery import ProbeTimings
from clipforge.launcher.stack import StackOutputs, load_stack_outputs
from clipforge.yamlfile import read_yaml_file


@dataclass(frozen=True, kw_only=True)
class Settings(ProbeTimings, RestartTimings):
    """The `clipforge` section of Fabric's config, each key declared once with its default and
    doc: the supervisor's restart timings (host.plan.RestartTimings), the recovery controller's
    probe timings (recovery.ProbeTimings), and the launcher's own below. docs/launcher.md's
    table is `settings_table()`."""

    SECTION = "clipforge"
    ERROR = LauncherError

    remote_root: str | None = knob(
        None,
        "where runs live on the hosts",
        default_doc="the stack's checkpoints volume, else `clipforge-runs` (in the SSH user's home)",
    )
    python: str = knob(
        "python3",
        "the host's interpreter, running the supervisor (and the stage with `--runtime host`); "
        "a venv's puts its `bin/` first on `PATH`",
        nonempty=True,
    )
    stack_outputs: Path = knob(Path("infra/stack-outputs.json"), "written by `make up`")
    min_free_gb: float = knob(20.0, "the disk row of the preflight", ge=0)
    shm_size: str = knob("16g", "docker runtime `/dev/shm`", nonempty=True)
    registry: str | None = knob(None, "image reference prefix", default_doc="`$REGISTRY`")
    socket_ifname: str | None = knob(
        None,
        "multi-node: the interface the ranks talk on, on every node (`GLOO_SOCKET_IFNAME`, "
        "`NCCL_SOCKET_IFNAME`)",
        default_doc="none: each node's route to node 0 (clipforge.launcher.network)",
    )


def defaults() -> dict[str, Any]:
    """Each setting's default, as Fabric's config holds it (the fabfile's collection config)."""
    return {
        f.name: str(f.default) if isinstance(f.default, Path) else f.default
        for f in dataclasses.fields(Settings)
    }


def settings_table() -> list[str]:
    """docs/launcher.md's table of settings, written from the declarations."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(Settings):
        default = f.metadata.get("default_doc") or _shown(f.default)
        rows.append(f"| `{f.name}` | {default} | {f.metadata['doc']} |")
    return rows


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return f"`{value}`" if isinstance(value, (str, Path)) else str(value)


def check_fabric_yaml(project_dir: Path, known: Iterable[str]) -> None:
    """Fabric reads fabric.yaml itself, after importing the fabfile: a YAML mistake there is a
    traceback from its reader, a section that is not a mapping an AmbiguousMergeError, a misspelt
    setting silently ignored. The fabfile calls this first; the user error names the file."""
    for path in (project_dir / "fabric.yaml", project_dir / "fabric.yml"):
        if not path.is_file():
            continue
        document = read_yaml_file(path) or {}  # a YamlFileError (a UserError) names the file
        if not isinstance(document, dict):
            raise LauncherError(f"{path}: must be a mapping of Fabric settings")
        section = document.get("clipforge") or {}
        if not isinstance(section, dict):
            raise LauncherError(f"{path}: `clipforge` must be a mapping of settings")
        unknown = sorted(set(section) - set(known))
        if unknown:
            raise LauncherError(
                f"{path}: clipforge.{unknown[0]} is not a setting; known: {', '.join(known)}"
            )


def settings_from(config) -> Settings:
    """Read the `clipforge` section of a Fabric/Invoke config. A FABRIC_CLIPFORGE_* variable of a
    key whose default is null arrives as a string (`""`: unset), and a number may be quoted in a
    YAML file, hence the conversions; Settings checks the rest."""
    section = config.get("clipforge")
    if section is None:
        raise LauncherError(
            "Fabric config has no `clipforge` section: run fab from the project root "
            "(its fabfile.py defines it)"
        )
    hints = typing.get_type_hints(Settings)
    values = {name: _from_text(section[name], hints[name]) for name in defaults()}
    if values["registry"] is None:
        values["registry"] = os.environ.get("REGISTRY") or None
    return Settings(**values)


def _from_text(value: Any, hint: Any) -> Any:
    optional = type(None) in typing.get_args(hint)
    if value == "" and optional:
        return None
    if isinstance(value, str) and hint in (int, float):
        try:
            return hint(value)
        except ValueError:
            return value  # Settings names the key and what it must be
    if str in (hint, *typing.get_args(hint)) and isinstance(value, (int, float)):
        return str(value)  # shm_size: 16, socket_ifname: 0 (YAML's numbers)
    return value


@dataclass
class Host:
    cxn: Connection
    label: str
    root: str  # absolute path on the host


def host_specs(cli_hosts: list[HostSpec], settings: Settings):
    return connection.targets(cli_hosts, lambda: load_stack_outputs(settings.stack_outputs))


def root_setting(settings: Settings, stack: StackOutputs | None) -> str:
    if settings.remote_root is not None:
        return settings.remote_root
    if stack and "checkpoints" in stack.mount_paths:
        # Retained storage: the run (code, checkpoints) outlives the worker pods.
        return posixpath.join(stack.mount_paths["checkpoints"], DEFAULT_ROOT)
    return DEFAULT_ROOT


def open_host(spec, config, settings: Settings, stack, accept_new_host_key: bool) -> Host:
    cxn = connection.connect(spec, config, accept_new_host_key)
    root = root_setting(settings, stack)
    result = run(
        cxn,
        f"{RESTRICT_UMASK} && mkdir -p {q(root)} && cd {q(root)} && pwd -P",
        what=f"creating {root}",
    )
    return Host(cxn=cxn, label=connection.label(cxn), root=result.stdout.strip())


def open_hosts(
    cli_hosts: list[HostSpec], config, settings: Settings, accept_new_host_key: bool = False
):
    specs, stack = host_specs(cli_hosts, settings)
    return [open_host(s, config, settings, stack, accept_new_host_key) for s in specs], stack


def launch_id_on(host: Host, requested: str | None) -> str:
    """--launch (a launch id) when given, else the newest launch on this host, as its `current`
    marker names it: a launch id, or an IdError naming the marker (it names a folder here)."""
    if requested:
        requested = checked_launch_id(requested, "--launch")
        if not probe(host.cxn, f"test -d {q(posixpath.join(host.root, 'runs', requested))}").ok:
            raise LauncherError(
                f"{host.label}: no run {requested} under {host.root}/runs "
                f"(`fab status` lists the newest; a launch is named by --launch)"
            )
        return requested
    marker = current_marker(host.root)
    result = probe(host.cxn, f"cat {q(marker)}")
    if not result.ok or not result.stdout.strip():
        raise LauncherError(f"{host.label}: no run launched under {host.root} yet (`fab train`)")
    return checked_launch_id(result.stdout.strip(), f"{host.label}:{marker}")


def node_layout(host: Host, index: int, requested_run: str | None) -> NodeLayout:
    """The node of the run that lives on this host: its position among the hosts is its rank."""
    launch_id = launch_id_on(host, requested_run)
    layout = NodeLayout(root=host.root, launch_id=launch_id, node_rank=index)
    if not probe(host.cxn, f"test -d {q(layout.node_dir)}").ok:
        raise LauncherError(
            f"{host.label}: run {launch_id} has no node {index} here (the hosts, in "
            f"order, must be those it was launched on)"
        )
    return layout


def remote_python(settings: Settings, layout: NodeLayout, module: str, *args: str) -> str:
    """A shell command running one of the host-side modules (clipforge.launcher.host) of the run's
    own code, with the run's umask, writing no bytecode into that code: where a root login hands
    the run to the image's user, a __pycache__ of root's would be unreadable to the containers
    (whose DVC walks the checkout)."""
    return (
        f"{RESTRICT_UMASK} && PYTHONDONTWRITEBYTECODE=1 "
        f"PYTHONPATH={q(posixpath.join(layout.code, 'src'))} "
        f"{q(settings.python)} -m clipforge.launcher.host.{module} {join(args)}"
    )


def container_user(host: Host, image: str) -> str:
    """`uid:gid` a run's containers run as: the SSH user's, so the run's files stay theirs; but
    never root (rented boxes often log in as root): then the image's own non-root user, to whom
    the launcher hands the run directory."""
    user = run(host.cxn, "echo $(id -u):$(id -g)", what="id").stdout.strip()
    if not user.startswith("0:"):
        return user
    configured = probe(host.cxn, f"docker image inspect --format '{{{{.Config.User}}}}' {q(image)}")
    image_user = configured.stdout.strip() if configured.ok else ""
    return image_user if image_user and image_user.split(":")[0] not in ("0", "root") else user


def later_container(
    host: Host, layout: NodeLayout, record: RunRecord, settings: Settings, what: str, **spec
) -> DockerSpec:
    """A container for a docker run's later work (`what`: push, tensorboard): the image and
    container user the run was launched with, as its record has them."""
    user = record.container_user or container_user(host, record.image)
    return run_container(record.image, layout, what, user=user, shm_size=settings.shm_size, **spec)


def read_remote_record(host: Host, layout: NodeLayout) -> RunRecord:
    """The node's run record (run.json); a missing or damaged one is the user's to look at."""
    result = probe(host.cxn, f"cat {q(layout.record)}")
    source = f"{host.label}:{layout.record}"
    if not result.ok:
        raise LauncherError(f"{source}: no run record there ({result.stderr.strip()})")
    return parse_record(result.stdout, source)  # RunRecordError (a UserError) names the fault


def read_remote_state(host: Host, layout: NodeLayout) -> SupervisorState | None:
    """The node's supervisor state (None: none yet); a damaged one is the user's to look at."""
    raw = read_remote_json(host, layout.state)
    return state_from_dict(raw, f"{host.label}:{layout.state}") if raw else None


def read_remote_json(host: Host, path: str) -> dict | None:
    result = probe(host.cxn, f"cat {q(path)}")
    if not result.ok:
        return None
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        return None


# Fabric's flags that say which hosts and how to reach them, with and without their value.
_CONNECTION_FLAGS = {"-H": True, "--hosts": True, "-i": True, "--identity": True}
_CONNECTION_FLAGS |= {"-S": True, "--ssh-config": True, "--prompt-for-passphrase": False}


def refuse_identity_after_task(argv: list[str], task: str) -> None:
    """`-i` after the task's name is the task's own -i (--image), not Fabric's -i KEY: refused,
    saying where the key goes, rather than failing later for want of a key (or with a key's path
    as the image)."""
    words = iter(argv[1:])
    for word in words:  # Fabric's flags, up to the task's name
        if word == task:
            break
        if _CONNECTION_FLAGS.get(word):
            next(words, None)
    late = [w for w in words if w == "-i" or (w.startswith("-i") and not w.startswith("--"))]
    if late:
        raise LauncherError(
            f"{late[0]} after the task is --image; the SSH key goes before the task: "
            f"fab -H HOST -i KEY {task} ..."
        )


def fab_command(argv: list[str]) -> str:
    """`fab` with the connection flags of this command line (-H, -i, -S as the user typed them),
    for the hints a task prints: `fab status` alone would look for the stack's workers."""
    kept, rest = ["fab"], iter(argv[1:])
    for arg in rest:
        flag = arg.split("=", 1)[0]
        if flag in _CONNECTION_FLAGS:
            kept.append(arg)
            if _CONNECTION_FLAGS[flag] and "=" not in arg:
                kept.append(next(rest, ""))
        elif len(arg) > 2 and arg[:2] in ("-H", "-i", "-S") and not arg.startswith("--"):
            kept.append(arg)  # -Hhost: the value glued to the flag
    return " ".join(q(a) for a in kept)
