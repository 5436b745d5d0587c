"""`fab rerun RUN`: a new launch of a finished run's commit, params and runtime, checked first.

The run is a folder `fab fetch` brought home (runs/<launch id>/, or any path), or a launch id
that only the run store holds (launches/<id>.json, and the training run's train.info.json). What
it is launched with is read from its launch record (run.json): the commit (shipped as `fab train`
ships one: launcher.source.source_at), the options (launch.stored_options: GPUs, nodes, the
overrides, the data mode, --smoke), the runtime and image, and the resolved params it recorded
(params.resolved.yaml). What must not have moved is read from its train.info.json: the data
manifest's sha256 (and the manifest) and the stack; they go into the new launch's record as
`repeats` (clipforge.repeats), which the train stage checks before it trains anything. Where it
runs is `fab train`'s choice (launcher.backend): -H/--on hosts, the stack's workers, or its
cluster with --kubernetes.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from clipforge.errors import UserError
from clipforge.ids import LAUNCH_ID
from clipforge.launcher.host.record import RunRecord, record_from_dict
from clipforge.launcher.launch import Prepared, stored_options
from clipforge.launcher.options import TrainOptions
from clipforge.launcher.run_source import StoredRun
from clipforge.launcher.source import source_at
from clipforge.repeats import Repeats
from clipforge.repro.run_folder import (
    RESOLVED_PARAMS_FILE,
    RunFolderError,
    find_run,
    read_run,
)

INFO_FILE = "metrics/train.info.json"


class RerunError(UserError):
    """The run cannot be repeated as it was: the message says what is missing."""


@dataclass(frozen=True)
class Original:
    """The run to repeat, as far as a rerun needs it."""

    name: str  # as the user named it
    record: RunRecord  # its launch record
    params_yaml: str  # the resolved params it was launched with
    info: dict  # its train.info.json


def find_original(spec: str, store: str | None, runs: Path = Path("runs")) -> Original:
    """A run folder, a launch id under `runs`, or a launch id in the run store `store`."""
    try:
        path = find_run(spec, runs)
    except RunFolderError:
        if not LAUNCH_ID.fullmatch(spec):
            raise
        return _from_store(spec, store)
    return _from_folder(spec, path)


def _from_folder(spec: str, path: Path) -> Original:
    folder = read_run(path)
    if folder.launch is None:
        raise RerunError(
            f"{path}: no launch record (node-0/run.json, store/record.json): `fab rerun` repeats "
            "runs `fab train` started; check out the commit train.info.json names and run "
            "`dvc exp run` with the params of models/clip/clipforge_config.yaml"
        )
    record = record_from_dict(folder.launch, f"{path}: its launch record")
    resolved = path / RESOLVED_PARAMS_FILE
    params_yaml = (
        resolved.read_text(encoding="utf-8") if resolved.is_file() else _as_yaml(record.params)
    )
    return Original(name=spec, record=record, params_yaml=params_yaml, info=folder.info)


def _from_store(launch_id: str, store: str | None) -> Original:
    stored = StoredRun.open(store, launch_id)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "train.info.json"
        if not stored.store.download_file(INFO_FILE, local):
            raise RerunError(
                f"run {launch_id} has not finished in the run store {store} (no {INFO_FILE} "
                f"under {stored.store.run_id}): only a finished run can be repeated"
            )
        try:
            info = json.loads(local.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise RerunError(
                f"{store}: {stored.store.run_id}/{INFO_FILE} is not JSON ({exc})"
            ) from None
    record = stored.record()
    return Original(name=launch_id, record=record, params_yaml=_as_yaml(record.params), info=info)


def _as_yaml(params: dict) -> str:
    return yaml.safe_dump(params, sort_keys=False, allow_unicode=True)


def repeats_of(original: Original, allow_stack_change: bool) -> Repeats:
    environment = original.info.get("environment") or {}
    manifest_sha256 = environment.get("data_manifest_sha256")
    if not manifest_sha256:
        raise RerunError(
            f"{original.name}: its train.info.json records no data manifest sha256 (a run from "
            "before the environment record): its data could not be checked, so it is not repeated"
        )
    manifest = original.info.get("data_manifest")
    return Repeats(
        launch_id=original.record.launch_id,
        run=original.name,
        training_run=original.info.get("run_id"),
        data_manifest_sha256=manifest_sha256,
        data_manifest=manifest if isinstance(manifest, dict) else None,
        stack=environment.get("stack"),
        allow_stack_change=allow_stack_change,
    )


def plan(
    original: Original, allow_stack_change: bool, start: Path
) -> tuple[Prepared, TrainOptions]:
    """The launch that repeats `original`: its commit from the repository at `start`, its
    options, image and resolved params as recorded, and what its train stage must check."""
    record = original.record
    return (
        Prepared(
            source=source_at(start, record.commit),
            params=record.params,
            params_yaml=original.params_yaml,
            image=record.image,
            store=record.store_remote,
            repeats=repeats_of(original, allow_stack_change).to_dict(),
        ),
        stored_options(record),
    )


def on_cluster(options: TrainOptions) -> TrainOptions:
    """The options on the stack's cluster: a run launched in the image (--runtime docker) runs
    there in a pod of that image, on its Python (as `fab train --kubernetes --resume` does)."""
    return dataclasses.replace(options, runtime="host") if options.runtime == "docker" else options


def describe(original: Original, prepared: Prepared, options: TrainOptions) -> list[str]:
    """What the rerun repeats and checks, said before it is launched."""
    repeats = prepared.repeats or {}
    stack = repeats.get("stack") or {}
    versions = ", ".join(
        f"{name} {stack[name]}" for name in ("python", "torch", "deepspeed") if stack.get(name)
    )
    record = original.record
    return [
        f"rerun of {original.name} (launch {record.launch_id}): commit {record.commit[:10]}, its "
        f"resolved params and overrides, {options.nodes} node(s) x {options.gpus} GPU(s), "
        f"--runtime {options.runtime} ({prepared.image}), --data {options.data}",
        f"before it trains, its train stage checks the data against manifest sha256 "
        f"{str(repeats.get('data_manifest_sha256'))[:12]} and the stack against the run's "
        f"({versions or 'not recorded'}"
        + ("; a different one is allowed)" if repeats.get("allow_stack_change") else ")")
        + ": a difference ends it in one line (`fab status`)",
    ]
