"""`make up` / `make down` / `make preview` through infra/infra.mk, run by the real `make`.

The Pulumi CLI cannot be installed here, so the error paths run with no `pulumi` on PATH, and the
happy paths with a stand-in `pulumi` that records its arguments and prints stack outputs: the
nearest real boundary, showing which commands make would run and what it writes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from infra_harness import INFRA_DIR, REPO
from stack_worker import forget_roots, record_root, stack_outputs, write_run

from clipforge.image_env import read_image_env

MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")
SYSTEM_PATH = "/usr/bin:/bin"  # git, make, sh; never a pulumi binary
STUB_OUTPUTS = {
    "namespace": "clipforge",
    "kube_context": "",
    "released": False,
    "workers": [{"pod": "clipforge-worker-0"}],
    "ssh": {"user": "clipforge", "port": 2222, "entry_pod": "clipforge-worker-0"},
    "tensorboard": {"service": "clipforge-tensorboard", "port": 6006},
    "cost": {"currency": "USD", "price_per_gpu_hour": "1.80", "gpus": 4, "per_hour": "7.20"},
}


def kubeconfig(path: Path, *contexts: str, current: str = "") -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": current,
                "contexts": [
                    {"name": name, "context": {"cluster": name, "user": name}} for name in contexts
                ],
                "clusters": [
                    {"name": name, "cluster": {"server": "https://127.0.0.1:6443"}}
                    for name in contexts
                ],
                "users": [{"name": name, "user": {}} for name in contexts],
            }
        )
    )
    return path


def stub_pulumi(bin_dir: Path, log: Path, fail_on: str = "", outputs: dict = STUB_OUTPUTS) -> None:
    """A `pulumi` that logs argv as JSON lines, prints `outputs` for `stack output`, and exits 1
    for the subcommand ``fail_on``."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "pulumi"
    script.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        args = sys.argv[1:]
        with open({str(log)!r}, "a") as out:
            out.write(json.dumps(args) + "\\n")
        if args[:1] == [{fail_on!r}]:
            sys.exit(1)
        if args[:2] == ["stack", "output"]:
            print(json.dumps({outputs!r}))
        """)
    )
    script.chmod(0o755)


def project_with_stack(tmp_path: Path, stack_values: dict) -> Path:
    """A copy of infra/'s Pulumi.yaml with one stack file, as a user's stack would look."""
    project = tmp_path / "infra"
    project.mkdir()
    shutil.copy(INFRA_DIR / "Pulumi.yaml", project / "Pulumi.yaml")
    config = {f"clipforge-infra:{key}": value for key, value in stack_values.items()}
    (project / "Pulumi.mine.yaml").write_text(yaml.safe_dump({"config": config}))
    return project


MY_STACK = {
    "kubeContext": "gpu-cluster",
    "gpusPerWorker": 4,
    "sshAuthorizedKeys": {"secure": "v1:c2FsdA==:Y2lwaGVydGV4dA=="},
}


def make(target: str, tmp_path: Path, *variables: str, path: str = SYSTEM_PATH, **env: str):
    # this checkout's clipforge, as its editable install gives it
    environment = {"PATH": path, "HOME": str(tmp_path), "PYTHONPATH": str(REPO / "src"), **env}
    command = [
        MAKE,
        "-s",
        "-f",
        str(INFRA_DIR / "infra.mk"),
        target,
        f"INFRA_PYTHON={sys.executable}",
        f"STACK_OUTPUTS={tmp_path / 'stack-outputs.json'}",
        *variables,
    ]
    return subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True)


def make_on_stack(target: str, tmp_path: Path, project: Path, *variables: str, **env: str):
    """`make TARGET STACK=mine` on `project`'s stack, with the stub pulumi first on PATH and a
    kubeconfig holding the stack's context."""
    return make(
        target,
        tmp_path,
        "STACK=mine",
        f"PULUMI_PROJECT_DIR={project}",
        *variables,
        path=f"{tmp_path / 'bin'}:{SYSTEM_PATH}",
        KUBECONFIG=str(kubeconfig(tmp_path / "kc", "gpu-cluster")),
        **env,
    )


def logged(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_up_without_stack_names_the_variable(tmp_path):
    """`make up` with no STACK says how to pass one."""
    done = make("up", tmp_path)
    assert done.returncode != 0
    assert "STACK=" in done.stderr


def test_up_without_pulumi_cli_says_how_to_install_it(tmp_path):
    """With no pulumi on PATH, `make up` fails before anything else, naming the Pulumi CLI."""
    done = make(
        "up",
        tmp_path,
        "STACK=example-1x4",
        KUBECONFIG=str(kubeconfig(tmp_path / "kc", "my-gpu-cluster")),
    )
    assert done.returncode != 0
    assert "Pulumi CLI is not on PATH" in done.stderr and "install" in done.stderr


def test_up_without_kubeconfig_names_it(tmp_path):
    """With the CLI present but no kubeconfig file, the error names the missing kubeconfig path."""
    stub_pulumi(tmp_path / "bin", tmp_path / "log")
    done = make(
        "up",
        tmp_path,
        "STACK=example-1x4",
        path=f"{tmp_path / 'bin'}:{SYSTEM_PATH}",
        KUBECONFIG=str(tmp_path / "nowhere"),
    )
    assert done.returncode != 0
    assert f"no kubeconfig at {tmp_path / 'nowhere'}" in done.stderr
    assert logged(tmp_path / "log") == []


def test_up_with_context_missing_from_kubeconfig_lists_the_known_ones(tmp_path):
    """The stack's kubeContext must exist in the kubeconfig; the error lists the contexts there."""
    stub_pulumi(tmp_path / "bin", tmp_path / "log")
    done = make(
        "up",
        tmp_path,
        "STACK=example-1x4",
        path=f"{tmp_path / 'bin'}:{SYSTEM_PATH}",
        KUBECONFIG=str(kubeconfig(tmp_path / "kc", "laptop-kind", current="laptop-kind")),
    )
    assert done.returncode != 0
    assert "'my-gpu-cluster' is not in the kubeconfig (laptop-kind)" in done.stderr
    assert logged(tmp_path / "log") == []


def test_up_runs_pulumi_with_image_from_image_env_and_writes_outputs(tmp_path):
    """`make up` selects the stack, sets image from docker/image.env + REGISTRY and released=false
    for the update only, runs `pulumi up`, then writes the stack outputs file."""
    project = project_with_stack(tmp_path, MY_STACK)
    stub_pulumi(tmp_path / "bin", tmp_path / "log")
    done = make_on_stack("up", tmp_path, project, "REGISTRY=registry.example/team")
    assert done.returncode == 0, done.stderr
    image = read_image_env(REPO / "docker" / "image.env").reference("registry.example/team")
    commands = [call[: call.index("--stack")] for call in logged(tmp_path / "log")]
    assert commands == [
        ["stack", "select", "--create"],
        ["config", "set", "released", "false"],
        ["config", "set", "image", image],
        ["up", "--yes", "--skip-preview"],
        ["config", "rm", "released"],
        ["config", "rm", "image"],
        ["stack", "output", "--json"],
    ]
    written = json.loads((tmp_path / "stack-outputs.json").read_text())
    assert written == {**STUB_OUTPUTS, "kube_context": "gpu-cluster"}  # the context make checked
    assert "7.20 USD/hour" in done.stdout
    assert "port-forward svc/clipforge-tensorboard 6006:6006" in done.stdout


def test_up_keeps_an_image_the_stack_sets(tmp_path):
    """A stack that sets `image` keeps it: make up does not pass docker/image.env's."""
    project = project_with_stack(tmp_path, {**MY_STACK, "image": "mirror.example/clipforge:custom"})
    stub_pulumi(tmp_path / "bin", tmp_path / "log")
    done = make_on_stack("up", tmp_path, project)
    assert done.returncode == 0, done.stderr
    assert not any(call[:3] == ["config", "set", "image"] for call in logged(tmp_path / "log"))


def test_failed_update_still_removes_transient_config_and_writes_no_outputs(tmp_path):
    """When `pulumi up` fails, the keys set for it are removed and no outputs file appears."""
    project = project_with_stack(tmp_path, MY_STACK)
    stub_pulumi(tmp_path / "bin", tmp_path / "log", fail_on="up")
    done = make_on_stack("up", tmp_path, project)
    assert done.returncode != 0
    calls = logged(tmp_path / "log")
    assert [c[:3] for c in calls if c[:2] == ["config", "rm"]] == [
        ["config", "rm", "released"],
        ["config", "rm", "image"],
    ]
    assert not (tmp_path / "stack-outputs.json").exists()


def test_stack_without_ssh_key_is_refused_with_the_command_to_set_it(tmp_path):
    """A stack lacking sshAuthorizedKeys fails before Pulumi runs, showing the `config set --secret` command."""
    project = project_with_stack(tmp_path, {"kubeContext": "gpu-cluster"})
    stub_pulumi(tmp_path / "bin", tmp_path / "log")
    done = make_on_stack("up", tmp_path, project)
    assert done.returncode != 0
    assert "config set --secret" in done.stderr and "sshAuthorizedKeys" in done.stderr
    assert logged(tmp_path / "log") == []


def test_misspelt_stack_key_is_refused(tmp_path):
    """A key Pulumi.yaml does not declare (a typo) stops make up instead of being ignored."""
    project = project_with_stack(tmp_path, {**MY_STACK, "gpusPerWorkers": 8})
    done = make("up", tmp_path, "STACK=mine", f"PULUMI_PROJECT_DIR={project}")
    assert done.returncode != 0
    assert "gpusPerWorkers" in done.stderr and "not declare" in done.stderr


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (
            "config:\n  clipforge-infra:gpusPerWorker: 4\n   clipforge-infra:numWorkers: 2\n",
            "3:30: mapping values are not allowed here",
        ),
        (
            "config:\n  clipforge-infra:gpusPerWorker: 4\n  clipforge-infra:gpusPerWorker: 8\n",
            "3:3: key 'clipforge-infra:gpusPerWorker' appears twice in one mapping (first on line 2)",
        ),
        ("config: [gpusPerWorker]\n", "`config` must be a mapping of clipforge-infra:KEY: value"),
    ],
)
def test_a_stack_file_that_does_not_parse_is_one_line_naming_it(tmp_path, content, problem):
    """A broken Pulumi.<stack>.yaml printed a YAML traceback; a key given twice silently kept the
    last value (Pulumi itself refuses it)."""
    stub_pulumi(tmp_path / "bin", tmp_path / "log")
    project = project_with_stack(tmp_path, MY_STACK)
    (project / "Pulumi.mine.yaml").write_text(content)
    done = make(
        "up",
        tmp_path,
        "STACK=mine",
        f"PULUMI_PROJECT_DIR={project}",
        path=f"{tmp_path / 'bin'}:{SYSTEM_PATH}",
    )
    assert done.returncode != 0
    separator = ":" if problem[0].isdigit() else ": "
    assert f"make up: {project / 'Pulumi.mine.yaml'}{separator}{problem}\n" in done.stderr
    assert "Traceback" not in done.stderr
    assert logged(tmp_path / "log") == []


def test_down_without_stack_names_the_target_that_was_run(tmp_path):
    """`make down` / `make preview` without STACK say to run that same target with STACK=, never
    `make up` (which would start paying for GPUs)."""
    for target in ("down", "preview"):
        done = make(target, tmp_path)
        assert done.returncode != 0 and f"`make {target} STACK=<name>`" in done.stderr
        assert "make up" not in done.stderr


def test_down_checks_stack_and_cli_before_any_checkpoint(tmp_path):
    """A checkout holding a demo's checkpoints/: `make down` first wants the Pulumi CLI; those
    local checkpoints are not the stack's and play no part."""
    run = tmp_path / "checkpoints" / "run-0123456789ab"
    (run / "step-00000093").mkdir(parents=True)
    (run / "latest").write_text("step-00000093")
    done = make(
        "down",
        tmp_path,
        "STACK=example-1x4",
        KUBECONFIG=str(kubeconfig(tmp_path / "kc", "my-gpu-cluster")),
    )
    assert done.returncode != 0
    assert "Pulumi CLI is not on PATH" in done.stderr and "checkpoint" not in done.stderr


@pytest.fixture
def stack_with_unsafe_run(sshd, tmp_path):
    """A stack (Pulumi stub) whose worker holds a run off retained storage, no DVC remote; the
    user's default key in HOME (which make() sets to tmp_path)."""
    (tmp_path / ".ssh").mkdir()
    shutil.copy(sshd.client_key, tmp_path / ".ssh" / "id_ed25519")
    forget_roots(sshd)
    write_run(tmp_path / "worker-disk", "20260101-000000-abcdef12", 70)
    record_root(sshd, tmp_path / "worker-disk")
    (tmp_path / "volume").mkdir()
    stub_pulumi(
        tmp_path / "bin", tmp_path / "log", outputs=stack_outputs(sshd, tmp_path / "volume")
    )
    return project_with_stack(tmp_path, MY_STACK)


def _down(tmp_path, project, *variables):
    return make_on_stack("down", tmp_path, project, *variables, CLIPFORGE_SSH_GATEWAY="none")


def test_down_refuses_while_a_run_on_the_stack_would_lose_its_checkpoint(
    stack_with_unsafe_run, tmp_path
):
    """`make down STACK=mine`: the guard reaches the worker, finds a run whose newest checkpoint
    is neither on retained storage nor in a DVC remote, and stops before any change, naming the
    run and `make down STACK=mine FORCE=1`."""
    done = _down(tmp_path, stack_with_unsafe_run)
    assert done.returncode != 0
    assert "refusing to release the GPUs" in done.stderr and "step-00000070" in done.stderr
    assert "20260101-000000-abcdef12" in done.stderr
    assert "`make down STACK=mine FORCE=1`" in done.stderr
    calls = logged(tmp_path / "log")
    assert [c[:2] for c in calls] == [["stack", "select"], ["stack", "output"]]


def test_down_with_force_proceeds_to_release(stack_with_unsafe_run, tmp_path):
    """FORCE=1 lets `make down` go past the guard to the release: `pulumi up` with released=true,
    never `pulumi destroy`."""
    done = _down(tmp_path, stack_with_unsafe_run, "FORCE=1")
    assert done.returncode == 0, done.stderr
    assert "releasing anyway" in done.stderr
    calls = logged(tmp_path / "log")
    assert ["config", "set", "released", "true"] in [c[:4] for c in calls]
    assert ["up", "--yes", "--skip-preview"] in [c[:3] for c in calls]
    assert not any("destroy" in call for call in calls)


def test_preview_previews_without_updating(tmp_path):
    """`make preview` runs `pulumi preview` and never `pulumi up`, writing no outputs file."""
    project = project_with_stack(tmp_path, MY_STACK)
    stub_pulumi(tmp_path / "bin", tmp_path / "log")
    done = make_on_stack("preview", tmp_path, project)
    assert done.returncode == 0, done.stderr
    subcommands = [call[0] for call in logged(tmp_path / "log")]
    assert "preview" in subcommands and "up" not in subcommands
    assert not (tmp_path / "stack-outputs.json").exists()


def test_infra_mk_defines_no_targets_the_top_level_makefile_owns():
    """infra.mk adds up/down/preview only, so `include infra/infra.mk` cannot clash with test/demo/env/all."""
    done = subprocess.run(
        [MAKE, "-pn", "-f", str(INFRA_DIR / "infra.mk")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": SYSTEM_PATH},
    )
    targets = {
        line.split(":")[0]
        for line in done.stdout.splitlines()
        if line and not line.startswith(("#", "\t", " ", ".")) and ":" in line and "=" not in line
    }
    assert {"up", "down", "preview"} <= targets
    assert not targets & {"test", "demo", "env", "all"}


def test_including_infra_mk_first_does_not_change_the_default_goal(tmp_path):
    """A Makefile that includes infra.mk before its own first target keeps that target as default."""
    (tmp_path / "Makefile").write_text(
        f"include {INFRA_DIR / 'infra.mk'}\nall:\n\t@echo top-level-all\n"
    )
    done = subprocess.run(
        [MAKE, "-s", "-C", str(tmp_path)], capture_output=True, text=True, env={"PATH": SYSTEM_PATH}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "top-level-all"
