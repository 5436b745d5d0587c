"""dvc.yaml names, for each stage, exactly the clipforge source files the stage runs and the
params sections it reads, so that an edit reruns the stages it affects and no other.

The files are derived here from the code: every module reachable from the stage's entry module
through its imports (those inside functions too), with the packages above each module (importing
clipforge.data.shards runs clipforge/__init__.py and clipforge/data/__init__.py first).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.support.imports import SRC, imported_modules, module_file

PIPELINE = {
    name: stage.get("do", stage)  # a foreach stage: its template
    for name, stage in yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))[
        "stages"
    ].items()
}
# The module holding each pipeline stage's main() and PARAMS (what it reads of params.yaml).
STAGE_MODULES = {
    "data": "clipforge.data.stage",
    "train": "clipforge.train.stage",
    "eval": "clipforge.eval.stage",
}
# The module each pipeline stage's params stage (`params-<stage>`) runs: the stage's params.
PARAMS_MODULES = {f"params-{stage}": f"clipforge.{stage}.config" for stage in STAGE_MODULES}
ALL_STAGES = sorted({*STAGE_MODULES, *PARAMS_MODULES})


def with_packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def reachable_files(entry: str) -> set[Path]:
    seen: set[str] = set()
    todo = [entry]
    while todo:
        for name in with_packages(todo.pop()):
            if name not in seen:
                seen.add(name)
                todo.extend(imported_modules(name))
    return {module_file(name) for name in seen}


def entry_module(command: str) -> str:
    """`python -m clipforge.data` runs clipforge/data/__main__.py; `-m clipforge.data.config`,
    data/config.py."""
    name = command.split(" -m ", 1)[1].split()[0]
    return f"{name}.__main__" if module_file(name).name == "__init__.py" else name


def stage_files(stage: str) -> set[Path]:
    return reachable_files(entry_module(PIPELINE[stage]["cmd"]))


def param_keys(stage: str) -> set[str]:
    """The params keys a stage depends on, from params.yaml or a resolved file."""
    keys: set[str] = set()
    for entry in PIPELINE[stage].get("params", []):
        if isinstance(entry, dict):  # {file: [keys]}
            keys.update(*entry.values())
        else:  # a key of params.yaml
            keys.add(entry)
    return keys


def code_deps(stage: str) -> list[Path]:
    return [REPO / dep for dep in PIPELINE[stage]["deps"] if dep.startswith("src/")]


def python_files(dep: Path) -> set[Path]:
    """The .py files a dep covers: itself, or every one under a directory."""
    assert dep.exists(), f"dvc.yaml names {dep.relative_to(REPO)}, which does not exist"
    if dep.is_dir():
        return set(dep.rglob("*.py"))
    return {dep} if dep.suffix == ".py" else set()


def test_the_import_graph_follows_imports_inside_functions_and_packages():
    """The train stage imports its run inside a function, and its params module the params
    stages' writer under `__main__`: both count, as does the __init__.py of every package on the
    way."""
    assert {
        SRC / "clipforge/train/run.py",
        SRC / "clipforge/resolve.py",
        SRC / "clipforge/alerts/__init__.py",
    } <= stage_files("train")


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_code_deps_are_exactly_the_modules_the_stage_imports(stage):
    """A module the stage imports and dvc.yaml misses would not rerun it when edited; a file
    dvc.yaml names that the stage never imports would rerun it for nothing."""
    imported = stage_files(stage)
    assert module_file({**STAGE_MODULES, **PARAMS_MODULES}[stage]) in imported
    covered = set().union(*(python_files(dep) for dep in code_deps(stage)))
    missing = sorted(str(p.relative_to(REPO)) for p in imported - covered)
    extra = sorted(str(p.relative_to(REPO)) for p in covered - imported)
    assert (missing, extra) == ([], [])


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_data_deps_are_read_by_the_stage(stage):
    """A dep without Python files (bundled model configs) is named by a module the stage runs."""
    sources = [p.read_text(encoding="utf-8") for p in stage_files(stage)]
    for dep in code_deps(stage):
        if not python_files(dep):
            assert any(f'"{dep.name}"' in text for text in sources), dep


@pytest.mark.parametrize("stage", sorted(STAGE_MODULES))
def test_params_are_the_sections_the_stage_reads(stage):
    """dvc.yaml's params of a stage are the sections the stage loads and checks, as
    resolved for it (resolved/<stage>.yaml, written by its params stage), and its params stage's
    are the same keys of params.yaml."""
    sections = list(importlib.import_module(STAGE_MODULES[stage]).PARAMS.sections())
    assert PIPELINE[stage]["params"] == [{f"resolved/{stage}.yaml": sections}]
    assert PIPELINE[f"params-{stage}"]["params"] == sections


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_every_code_dep_is_needed(stage):
    """Each code dep covers some module no other dep covers: a file listed again inside a listed
    directory, or twice, is noise that hides what the stage runs."""
    deps = code_deps(stage)
    assert len(deps) == len(set(deps)), "a dep is listed twice"
    for dep in deps:
        others = set().union(*(python_files(d) for d in deps if d != dep))
        if python_files(dep):
            assert python_files(dep) - others, f"{dep.relative_to(REPO)} adds no module"


def test_train_runs_no_eval_stage_code():
    """Validation counts recall with the leaf clipforge.metrics, not the eval stage: editing
    eval's CLI or model loading does not make a training run stale."""
    eval_package = SRC / "clipforge" / "eval"
    assert not any(eval_package in p.parents for p in stage_files("train"))
    assert not any(eval_package in (dep, *dep.parents) for dep in code_deps("train"))


@pytest.mark.parametrize("stage", ["params-data", "data", "params-eval", "eval"])
def test_stages_without_alerts_or_a_store_run_none_of_their_code(stage):
    """Each stage loads only its own sections: editing an alert's default or the run store's
    settings (code or params) leaves the data and eval stages, and their params, up to date."""
    for package in ("alerts", "store"):
        root = SRC / "clipforge" / package
        assert not [p for p in stage_files(stage) if root in p.parents], (stage, package)
    assert not {"alerts", "storage"} & param_keys(stage)
