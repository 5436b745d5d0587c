"""The host side (clipforge.launcher.host) imports nothing outside the standard library.

On a docker-runtime host it runs under the host's own python3, outside the training image, with
only the run's checkout on PYTHONPATH: a third-party import there breaks every run on such hosts,
and nothing else would notice until then. Checked twice: statically, through every import
statement of every module the host side reaches (imports inside functions too), and by
importing each host module in a Python that has no site-packages at all.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.support.records import run_record

SRC = REPO / "src"
HOST_PACKAGE = "clipforge.launcher.host"
# Project modules the host side may use: its own package, the packages that contain it (they run
# first on import), the user-error type (clipforge.errors), the atomic writes (clipforge.fsutil),
# the small helpers and the two ids (clipforge.util, clipforge.ids), and the alert delivery the
# supervisor shares with the stage (clipforge.alerts' events, config, formats, targets, delivery), and the
# ranks' heartbeats its hang watchdog reads (clipforge.progress), and the
# checkpoints' names (clipforge.checkpoints.layout, shipped inline by stored_checkpoints), and the
# run store uploader's state that status reads (clipforge.store.sync_state), and a failed
# stage's fault record the supervisor reads (clipforge.fault_record).
ALLOWED_PROJECT = (
    "clipforge",
    "clipforge.errors",
    "clipforge.fault_record",
    "clipforge.fsutil",
    "clipforge.ids",
    "clipforge.util",
    "clipforge.checkpoints",
    "clipforge.checkpoints.layout",
    "clipforge.launcher",
    HOST_PACKAGE,
    "clipforge.alerts",
    "clipforge.alerts.config",
    "clipforge.alerts.delivery",
    "clipforge.alerts.events",
    "clipforge.alerts.formats",
    "clipforge.progress",
    "clipforge.alerts.targets",
    "clipforge.fields",
    "clipforge.store",
    "clipforge.store.sync_state",
)


def _module_file(name: str, src: Path) -> Path | None:
    path = src.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _imports(name: str, src: Path) -> set[str]:
    """Every module an import statement of module `name` names (`from a import b`: a, and a.b
    when that is a module), plus the packages a module's import runs first."""
    path = _module_file(name, src)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = {name.rsplit(".", depth)[0] for depth in range(1, name.count(".") + 1)}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            found.add(base)
            found |= {
                f"{base}.{alias.name}"
                for alias in node.names
                if _module_file(f"{base}.{alias.name}", src)
            }
    return found


def outside_imports(roots: list[str], src: Path, allowed: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> what it imports that is neither standard library nor allowed, over the closure
    of `roots`' imports within `src`."""
    problems: dict[str, set[str]] = {}
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in _imports(name, src):
            top = imported.split(".")[0]
            if top in sys.stdlib_module_names:
                continue
            if imported in allowed or imported.startswith(HOST_PACKAGE + "."):
                todo.append(imported)
            else:
                problems.setdefault(name, set()).add(imported)
    return problems


def _host_modules() -> list[str]:
    return sorted(
        f"{HOST_PACKAGE}.{path.stem}".removesuffix(".__init__")
        for path in SRC.joinpath(*HOST_PACKAGE.split(".")).glob("*.py")
    )


def test_the_host_side_imports_only_the_standard_library_and_itself():
    """Every import reachable from a host module is standard library, the host package, the
    packages above it, or the allowed project modules (which hold to the same rule)."""
    modules = _host_modules()
    assert f"{HOST_PACKAGE}.supervisor" in modules and f"{HOST_PACKAGE}.status" in modules
    assert outside_imports(modules, SRC, ALLOWED_PROJECT) == {}


def test_the_check_catches_a_third_party_import(tmp_path):
    """The same check on a host package with one `import yaml` (inside a function) names it, and
    names a project module outside the allowed ones."""
    host = tmp_path.joinpath(*HOST_PACKAGE.split("."))
    host.mkdir(parents=True)
    for package in (tmp_path / "clipforge", host.parent, host):
        (package / "__init__.py").touch()
    (host / "plan.py").write_text("import json\n\n\ndef load():\n    import yaml\n")
    (host / "status.py").write_text("from clipforge.config import Config\nfrom . import plan\n")
    problems = outside_imports([f"{HOST_PACKAGE}.status"], tmp_path, ALLOWED_PROJECT)
    assert problems == {
        f"{HOST_PACKAGE}.plan": {"yaml"},
        f"{HOST_PACKAGE}.status": {"clipforge.config"},
    }


def test_every_host_module_imports_without_site_packages():
    """`python -S` (no site-packages) with only src/ on the path imports every host module, as
    the host's own python3 would with the run's checkout."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(SRC)}
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run(
        [sys.executable, "-S", "-c", script, *_host_modules()],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_the_stored_checkpoints_script_runs_alone_with_its_clipforge_modules_inlined(tmp_path):
    """What `make down`'s guard and `fab clean` send to a worker runs under `python3 -S` with
    nothing of clipforge importable, names the newest finished checkpoint of a run whose `latest`
    is gone (`latest` being a hint), and the run store its record names (the record's reader
    inlined too)."""
    from clipforge.launcher.host.stored_checkpoints import script_source

    launch_dir = tmp_path / "runs" / "r1"
    run_dir = launch_dir / "node-0" / "code" / "checkpoints" / "run-abc"
    for step, manifest in ((4, True), (8, True), (12, False)):
        (run_dir / f"step-{step:08d}").mkdir(parents=True)
        (run_dir / f"step-{step:08d}" / "model.pt").write_bytes(b"weights")
        if manifest:
            (run_dir / f"step-{step:08d}" / "manifest.json").write_text("{}")
    record = run_record(
        params={"storage": {"remote": "s3://bucket/runs"}}, checkpoints_dir=str(tmp_path / "gone")
    )
    (launch_dir / "run.json").write_text(record.to_json())
    result = subprocess.run(
        [sys.executable, "-S", "-c", script_source(), "--root", str(tmp_path)],
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    (entry,) = json.loads(result.stdout)
    assert (entry["run_id"], entry["tag"], entry["problem"], entry["store"]) == (
        "run-abc",
        "step-00000008",
        None,
        "s3://bucket/runs",
    )
