"""src/clipforge's packages form layers: a package imports only from layers below its own, so the
package import graph has no cycle and no package reaches up into one that builds on it.

The graph is derived from the code: every import statement of every module (those inside
functions too, relative ones resolved), each module belonging to its innermost package (the root
package `clipforge` holds the modules directly under src/clipforge).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

from tests.conftest import REPO, subprocess_env
from tests.support.imports import SRC, imported_modules, package_of

# The layers, lowest first. A package may import its own modules and those of packages in lower
# layers; two packages of one layer are independent of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    # the leaves every package uses: errors, util, fsutil, fields, yamlfile, ids, image_env...
    ("clipforge",),
    ("clipforge.metrics", "clipforge.alerts", "clipforge.model", "clipforge.checkpoints"),
    ("clipforge.store", "clipforge.data", "clipforge.export"),
    ("clipforge.train", "clipforge.eval"),
    ("clipforge.pipeline", "clipforge.repro"),
    ("clipforge.launcher.host",),
    ("clipforge.launcher",),
)


def _modules() -> Iterator[str]:
    for path in sorted((SRC / "clipforge").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the module imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module in _modules():
        for target in sorted(imported_modules(module)):
            edge = (package_of(module), package_of(target))
            if edge[0] != edge[1]:
                edges.setdefault(edge, []).append(f"{module} -> {target}")
    return edges


def layer_violations(
    edges: dict[tuple[str, str], list[str]], layers: tuple[tuple[str, ...], ...]
) -> list[str]:
    """One line per package edge that does not go to a lower layer, naming an import behind it."""
    rank = {package: i for i, layer in enumerate(layers) for package in layer}
    return [
        f"{source} (layer {rank[source]}) imports {target} (layer {rank[target]}): {why[0]}"
        for (source, target), why in sorted(edges.items())
        if rank[target] >= rank[source]
    ]


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The package cycles of the graph, each as the packages along it (first one repeated)."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    found, done = [], set()

    def visit(package: str, path: list[str]) -> None:
        if package in path:
            found.append(path[path.index(package) :] + [package])
            return
        if package in done:
            return
        for target in sorted(graph.get(package, ())):
            visit(target, [*path, package])
        done.add(package)

    for package in sorted(graph):
        visit(package, [])
    return found


def test_every_package_has_a_layer():
    """A new package is placed in a layer before it is used: none is left out, none listed is
    gone."""
    packages = {package_of(module) for module in _modules()}
    listed = [package for layer in LAYERS for package in layer]
    assert len(listed) == len(set(listed)), "a package is in two layers"
    assert (sorted(packages - set(listed)), sorted(set(listed) - packages)) == ([], [])


def test_packages_import_only_from_lower_layers():
    """No package imports one of its own layer or above."""
    assert layer_violations(package_imports(), LAYERS) == []


def test_the_package_graph_has_no_cycle():
    assert cycles(package_imports()) == []


def test_an_upward_import_and_a_cycle_are_named():
    """The checks find what they are for, on a graph made for it: a lower package importing a
    higher one is named with the import behind it, and the cycle it closes is found."""
    edges = {
        ("clipforge.store", "clipforge.checkpoints"): ["clipforge.store.remote -> x"],
        ("clipforge.checkpoints", "clipforge.store"): ["clipforge.checkpoints.resume -> y"],
    }
    assert layer_violations(edges, LAYERS) == [
        "clipforge.checkpoints (layer 1) imports clipforge.store (layer 2): "
        "clipforge.checkpoints.resume -> y"
    ]
    assert cycles(edges) == [["clipforge.checkpoints", "clipforge.store", "clipforge.checkpoints"]]


# The processes a launch starts many of: `fab` on the laptop (every command), and on each host the
# supervisor, its keeper and `fab status`'s reader. Importing torch costs each of them seconds
# (about 10 on a busy 2-core machine), so none may, directly or through a module they import.
_LIGHT = (
    "fabfile",
    "clipforge.launcher.host.supervisor",
    "clipforge.launcher.host.keeper",
    "clipforge.launcher.host.status",
)
_HEAVY = ("torch", "deepspeed", "open_clip", "transformers")


def test_fab_and_the_host_side_processes_start_without_torch():
    program = (
        f"import importlib, sys; [importlib.import_module(m) for m in {_LIGHT!r}]; "
        f"print(sorted(m for m in {_HEAVY!r} if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", program],
        cwd=REPO,
        env={**subprocess_env(), "PYTHONPATH": f"{REPO}:{SRC}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"
