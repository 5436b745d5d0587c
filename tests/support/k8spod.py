"""A rendered pod of `fab train --kubernetes` as a process on this machine: its container's args
and env exactly as rendered (literal values and the run's Secret), its ConfigMaps written where
they are mounted, and what the image gives (its `python`: the interpreter running these tests).
A Job's pod or a JobSet's; an indexed pod's JOB_COMPLETION_INDEX is what its Job controller
would set, so the caller passes it."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from clipforge.launcher import kubernetes as kube
from clipforge.launcher import kubernetes_objects as k8s_objects
from clipforge.launcher.launch import prepare
from clipforge.launcher.options import make_options
from clipforge.launcher.source import current_source
from tests.launcher.conftest import RUN_SETS
from tests.launcher.test_kubernetes import IMAGE, SETTINGS, stack_outputs


@dataclass(frozen=True)
class RenderedRun:
    launch_id: str
    objects: list[dict]
    store: Path  # the run store (storage.remote)
    go: Path  # created to let the pods past their wait@ fault
    checkpoints: Path  # the checkpoints volume, as the pods mount it


def render_cpu_run(project: Path, base: Path, nodes: int, wait_step: int) -> RenderedRun:
    """`fab train --kubernetes`'s objects for RUN_SETS' CPU run of `project` on `nodes` nodes:
    the stack's volumes are folders under `base`, the run store `base/store`, and every pod waits
    at `wait_step` until `go` exists."""
    volumes = {role: base / "volumes" / role for role in ("datasets", "checkpoints", "logs")}
    for path in volumes.values():
        path.mkdir(parents=True)
    raw = stack_outputs()
    raw["volumes"] = {
        role: {**raw["volumes"][role], "mount_path": str(path)} for role, path in volumes.items()
    }
    cluster = k8s_objects.parse_cluster(raw, "outputs")
    store, go = base / "store", base / "go"
    options = make_options(
        gpus=0,
        nodes=nodes,
        sets=[*RUN_SETS, f"storage.remote={store}"],
        smoke=False,
        runtime="host",
        allow_dirty=False,
        data="build",
        image=IMAGE,
    )
    prepared = prepare(current_source(project), options, SETTINGS)
    launch_id, objects = kube.build(
        cluster,
        prepared,
        options,
        SETTINGS,
        2,
        {"CLIPFORGE_FAULTS": f"wait@{wait_step}={go}"},
        run_files_mount=str(base / "run-files"),
    )
    return RenderedRun(launch_id, objects, store, go, volumes["checkpoints"])


def stored_step(store: Path) -> str | None:
    """The checkpoint tag the run store's `latest` names (None: none yet)."""
    markers = list(store.glob("*/checkpoints/latest"))
    return markers[0].read_text().strip() if markers else None


def pod_template(workload: dict) -> dict:
    """The pod template of a Job or of a JobSet's one replicated Job."""
    if workload["kind"] == "Job":
        return workload["spec"]["template"]
    assert workload["kind"] == "JobSet", workload["kind"]
    (replicated,) = workload["spec"]["replicatedJobs"]
    return replicated["template"]["spec"]["template"]


class Pod:
    """One pod of the run, started as a process (`start`), its output in `workdir/<name>.log`."""

    def __init__(
        self,
        objects: list[dict],
        run_files: Path,
        workdir: Path,
        env: dict[str, str] | None = None,
    ):
        container = pod_template(objects[-1])["spec"]["containers"][0]
        self.args = container["args"]
        secret = next(o for o in objects if o["kind"] == "Secret")
        rendered = {e["name"]: e["value"] for e in container["env"]}
        # The image's PATH (its `python`: here, the interpreter running these tests) and HOME.
        self.env = {
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
            "HOME": str(workdir / "home"),
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", ""),
            **rendered,
            **secret["stringData"],
            **(env or {}),
        }
        (workdir / "home").mkdir(parents=True, exist_ok=True)
        run_files.mkdir(parents=True, exist_ok=True)
        for config_map in (o for o in objects if o["kind"] == "ConfigMap"):
            for name, text in config_map.get("data", {}).items():
                (run_files / name).write_text(text)
            for name, data in config_map.get("binaryData", {}).items():
                (run_files / name).write_bytes(base64.b64decode(data))
        self.workdir = workdir

    def start(self, name: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        """The container's command, after `prefix` (e.g. what puts it in a namespace)."""
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115  (the process keeps it)
        return subprocess.Popen(
            [*prefix, *self.args],
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-4000:]
