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
from pathlib import Path


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
