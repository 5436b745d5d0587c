"""tests/ mirrors src/clipforge, so a module's tests are found from its path: a test file sits in
tests/<package path>/ of an existing clipforge package, a root module's at the top of tests/
named after it (test_<module>.py, test_<module>_<aspect>.py). tests/infra/ and tests/docker/ test
those trees, tests/support/ holds helpers; the cross-cutting checks below are the only others."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO

# Folders that test something other than src/clipforge, or hold helpers.
OTHER_TREES = ("infra", "docker", "support")
# Top-level files about the project as a whole (its docs, Makefile, packaging, clone, bench).
CROSS_CUTTING = {
    "test_clean_clone.py",
    "test_code_map.py",
    "test_gpu_bench.py",
    "test_layout.py",
    "test_makefile.py",
    "test_package_layers.py",
    "test_project_metadata.py",
    "test_readme_commands.py",
    "test_remedies.py",
}


def misplaced(tests: Path, package: Path) -> list[str]:
    """Each test file of `tests` that does not sit where the module it tests is in `package`."""
    root_modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    problems = []
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests)
        folders = rel.parts[:-1]
        if folders and folders[0] in OTHER_TREES:
            continue
        if not folders:
            stem = path.stem.removeprefix("test_")
            named = any(stem == m or stem.startswith(m + "_") for m in root_modules)
            if not named and path.name not in CROSS_CUTTING:
                problems.append(f"{rel}: names no module of {package.name}/ (nor is cross-cutting)")
        elif not (package.joinpath(*folders) / "__init__.py").is_file():
            problems.append(f"{rel}: {package.name}/{'/'.join(folders)} is no package")
        elif not (path.parent / "__init__.py").is_file():
            problems.append(f"{rel}: its folder has no __init__.py (same-named files would clash)")
    return problems


def test_every_test_file_sits_where_the_module_it_tests_is():
    assert misplaced(REPO / "tests", REPO / "src" / "clipforge") == []


def test_a_kind_folder_a_gone_package_a_non_package_or_an_unnamed_top_file_is_caught(tmp_path):
    package, tests = tmp_path / "src" / "clipforge", tmp_path / "tests"
    for folder in (package / "train", tests / "train", tests / "unit", tests / "infra"):
        folder.mkdir(parents=True)
        (folder / "__init__.py").touch()
    (package / "util.py").touch()
    (package / "eval").mkdir()
    (package / "eval" / "__init__.py").touch()
    (tests / "gone").mkdir()
    (tests / "eval").mkdir()
    for name in (
        "train/test_loop.py",
        "eval/test_stage.py",
        "unit/test_loop.py",
        "gone/test_x.py",
        "infra/test_stack.py",
        "test_util_backoff.py",
        "test_utility.py",
        "test_makefile.py",
    ):
        (tests / name).touch()
    assert misplaced(tests, package) == [
        "eval/test_stage.py: its folder has no __init__.py (same-named files would clash)",
        "gone/test_x.py: clipforge/gone is no package",
        "test_utility.py: names no module of clipforge/ (nor is cross-cutting)",
        "unit/test_loop.py: clipforge/unit is no package",
    ]
