"""A finished run as a folder: its params, data, environment, metrics and weights, read once.

The folders `fab compare`, `fab publish` and `fab rerun` read: a run `fab fetch` brought home
(runs/<launch id>/), a local experiment's workspace, or any folder the train stage wrote into
(metrics/, models/clip/). The resolved params are the export's own (clipforge_config.yaml); the
environment is train.info.json's (clipforge.envrecord).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from clipforge.envrecord import RESULT_KEY
from clipforge.errors import UserError
from clipforge.fsutil import sha256_file
from clipforge.model.files import WEIGHTS_FILES
from clipforge.util import flatten
from clipforge.yamlfile import load_yaml

MODEL_DIR = "models/clip"
PARAMS_FILE = "clipforge_config.yaml"  # in the export: the resolved params the stage ran with
# What compares models (dvc metrics show lists them): train's final numbers, eval's scores.
METRIC_FILES = ("metrics/train.json", "metrics/eval.json")
# Where a fetched run keeps its launch record: from the hosts (node 0's), or the run store's
# record of the training run, which holds it under `launch` (clipforge.store.uploader).
RECORD_FILES = ("node-0/run.json", "run.json")
STORE_RECORD = "store/record.json"
# Where a fetched run keeps the resolved params its launch wrote (from the hosts only).
RESOLVED_PARAMS_FILE = "node-0/params.resolved.yaml"


class RunFolderError(UserError):
    """The folder is not a finished run's: the message says what is missing."""


@dataclass(frozen=True)
class RunFolder:
    path: Path
    params: dict  # the resolved params, as parsed YAML
    params_text: str
    environment: dict | None  # train.info.json's environment record (None: an older run)
    info: dict  # train.info.json
    metric_files: dict[str, dict]  # each of METRIC_FILES the run has, parsed, by that path
    weights_file: str
    launch: dict | None  # the launch record (run.json), when `fab train` started the run

    @property
    def model_dir(self) -> Path:
        return self.path / MODEL_DIR

    @cached_property
    def metrics(self) -> dict[str, float]:
        """The numbers, flattened, by file stem: "train.loss", "eval.test.mean_recall", ..."""
        found: dict = {}
        for name, data in self.metric_files.items():
            found.update(flatten(data, Path(name).stem))
        return {k: v for k, v in found.items() if isinstance(v, (int, float))}

    @cached_property
    def weights_sha256(self) -> str:
        """Read when asked: `fab runs` lists many runs and compares no weights."""
        return sha256_file(self.model_dir / self.weights_file)

    @property
    def launch_id(self) -> str | None:
        """The launch id its launch record names; None: `fab train` did not start it."""
        launch_id = (self.launch or {}).get("launch_id")
        return launch_id if isinstance(launch_id, str) else None

    @property
    def smoke(self) -> bool:
        """`fab train --smoke` started it (a few steps: a host checked, not a model)."""
        return (self.launch or {}).get("smoke") is True

    @property
    def data_manifest_sha256(self) -> str | None:
        return (self.environment or {}).get("data_manifest_sha256")

    @property
    def name(self) -> str:
        return self.path.name


def find_run(spec: str, runs: Path = Path("runs")) -> Path:
    """A run given as a folder, or as a launch id under runs/ (where `fab fetch` puts it)."""
    for candidate in (Path(spec), runs / spec):
        if (candidate / MODEL_DIR).is_dir() or (candidate / "metrics").is_dir():
            return candidate
    raise RunFolderError(
        f"{spec}: no run there (a folder with metrics/ and {MODEL_DIR}/, or a launch id under "
        f"{runs}/); bring a remote run home first with `fab fetch --launch {spec}`"
    )


def read_run(path: Path) -> RunFolder:
    model = path / MODEL_DIR
    params_file = model / PARAMS_FILE
    info_file = path / "metrics" / "train.info.json"
    weights = next((model / n for n in WEIGHTS_FILES if (model / n).is_file()), None)
    missing = [str(p.relative_to(path)) for p in (params_file, info_file) if not p.is_file()] + (
        [] if weights else [f"{MODEL_DIR}/{WEIGHTS_FILES[0]}"]
    )
    if missing or weights is None:
        raise RunFolderError(f"{path}: not a finished run, missing {', '.join(missing)}")
    params_text = params_file.read_text(encoding="utf-8")
    info = _json(info_file)
    return RunFolder(
        path=path,
        params=load_yaml(params_text) or {},
        params_text=params_text,
        environment=info.get(RESULT_KEY),
        info=info,
        metric_files=_metric_files(path),
        weights_file=weights.name,
        launch=launch_record(path),
    )


def launch_record(path: Path) -> dict | None:
    """The launch record (run.json, parsed) a fetched run holds; None: not one `fab train`
    started (or fetched before the store kept it)."""
    for name in RECORD_FILES:
        if (path / name).is_file():
            return _json(path / name)
    if (path / STORE_RECORD).is_file():
        launch = _json(path / STORE_RECORD).get("launch")
        return launch if isinstance(launch, dict) else None
    return None


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise RunFolderError(f"{path}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise RunFolderError(f"{path}: not a JSON object")
    return value


def _metric_files(path: Path) -> dict[str, dict]:
    return {name: _json(path / name) for name in METRIC_FILES if (path / name).is_file()}
