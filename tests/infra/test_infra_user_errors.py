"""User errors and bugs in `make up/down/preview`: stackctl's shell turns a UserError (raised where
the problem is found: a stack file, the kubeconfig, the Pulumi CLI, the image.env) into one line and
exit 2, and nothing else; a bug keeps its traceback. The teardown guard's "cannot decide" is a user
error too, and a refusal; a bug in the guard is no refusal but a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml
from infra_harness import INFRA_DIR, REPO

from clipforge.errors import UserError
from clipforge.yamlfile import YamlFileError
from clipforge_infra import stackctl, teardown_guard
from clipforge_infra.kubeconfig import KubeconfigError
from clipforge_infra.quantities import QuantityError
from clipforge_infra.stack_files import StackFileError
from clipforge_infra.stackctl import EXIT_USAGE, StackctlError
from clipforge_infra.teardown_guard import GuardError
from tests.conftest import subprocess_env

STACK = {
    "kubeContext": "gpu-cluster",
    "sshAuthorizedKeys": {"secure": "v1:c2FsdA==:Y2lwaGVydGV4dA=="},
}
# What a stub `pulumi stack output --json` prints: one worker, reached through 127.0.0.1.
OUTPUTS = {
    "released": False,
    "namespace": "clipforge",
    "workers": [{"pod": "clipforge-worker-0", "host": "127.0.0.1"}],
    "ssh": {"user": "clipforge", "port": 2222, "entry_pod": "clipforge-worker-0"},
}


def test_every_infra_user_error_type_is_a_user_error():
    """stackctl's shell catches UserError alone; the builtin bases stay for their callers."""
    for error in (KubeconfigError, StackctlError, GuardError):
        assert issubclass(error, UserError) and issubclass(error, RuntimeError), error
    for error in (StackFileError, QuantityError):
        assert issubclass(error, UserError) and issubclass(error, ValueError), error


@pytest.fixture
def stack(tmp_path, monkeypatch) -> list[str]:
    """A project with stack `mine`, a kubeconfig holding its context and a stand-in `pulumi` on
    PATH that prints OUTPUTS for `stack output`; stackctl's arguments for it, less the command."""
    project = tmp_path / "infra"
    project.mkdir()
    (project / "Pulumi.yaml").write_text((INFRA_DIR / "Pulumi.yaml").read_text())
    config = {f"clipforge-infra:{key}": value for key, value in STACK.items()}
    (project / "Pulumi.mine.yaml").write_text(yaml.safe_dump({"config": config}))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({"contexts": [{"name": "gpu-cluster"}]}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pulumi = bin_dir / "pulumi"
    pulumi.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        if sys.argv[1:3] == ["stack", "output"]:
            print({json.dumps(OUTPUTS)!r})
        """)
    )
    pulumi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return ["--stack", "mine", "--project-dir", str(project), "--outputs", str(tmp_path / "o.json")]


@pytest.mark.parametrize(
    ("argv", "stack_file", "said"),
    [
        (["up"], None, "no stack: run `make up STACK=<name>`"),
        (["--stack", "theirs"], None, "no stack file "),
        ([], "config: [a\n", "Pulumi.mine.yaml:2:1: "),
        ([], "- a list\n", "Pulumi.mine.yaml: not a YAML mapping"),
        (["--image-env", "no-image.env"], None, "no-image.env"),
    ],
    ids=["no-stack", "no-stack-file", "stack-file-not-yaml", "stack-file-not-mapping", "image-env"],
)
def test_a_user_error_of_make_up_is_one_line_and_exit_2(
    stack, tmp_path, capsys, argv, stack_file, said
):
    """Each is raised where it is found (stackctl, stack_files, clipforge.yamlfile, image_env),
    as its own type, and reaches the shell as such: no relabelling on the way."""
    if stack_file is not None:
        (tmp_path / "infra" / "Pulumi.mine.yaml").write_text(stack_file)
    assert stackctl.main(argv if argv == ["up"] else ["up", *stack, *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("make up: ") and said in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_kubeconfig_without_the_stacks_context_is_one_line_and_exit_2(stack, tmp_path, capsys):
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump({"contexts": [{"name": "laptop"}]}))
    assert stackctl.main(["preview", *stack]) == EXIT_USAGE
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("make preview: context 'gpu-cluster' is not in the kubeconfig (laptop)")


def test_a_yaml_error_of_the_stack_file_reaches_the_shell_as_itself(stack, tmp_path):
    """The reader's YamlFileError is already the user error: stack_files passes it on."""
    (tmp_path / "infra" / "Pulumi.mine.yaml").write_text("config: [a\n")
    with pytest.raises(YamlFileError):
        stackctl.prepare_invocation(stackctl.parse_args(["up", *stack]), {"PATH": ""})


@pytest.mark.parametrize(
    ("command", "module", "function"),
    [("up", "stackctl", "load_declarations"), ("down", "teardown_guard", "parse_stack_outputs")],
)
def test_a_bug_in_make_up_or_down_keeps_its_traceback(stack, command, module, function):
    """A KeyError from the code (here injected: in reading the project's declarations, in the
    guard's reading of the stack outputs) is no user error and no refusal: the process prints the
    traceback and exits 1, not 2 (a user error) or 3 (the guard's refusal)."""
    script = (
        "import sys\n"
        f"import clipforge_infra.{module} as target\n"
        "def bug(*args, **kwargs):\n"
        "    raise KeyError('an injected bug')\n"
        f"target.{function} = bug\n"
        "from clipforge_infra.stackctl import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    env = {**subprocess_env(), "PYTHONPATH": f"{INFRA_DIR}:{REPO / 'src'}"}
    result = subprocess.run(
        [sys.executable, "-c", script, command, *stack],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    assert "in bug" in result.stderr and "KeyError: 'an injected bug'" in result.stderr
    assert f"make {command}:" not in result.stderr
    assert "refusing to release" not in result.stderr


def test_damaged_stack_outputs_are_a_refusal_of_the_guard(tmp_path, capsys):
    """The launcher's LauncherError from reading the outputs is a user error: the guard cannot
    decide, so it refuses, saying why, with no traceback."""
    outputs = {**OUTPUTS, "workers": [{"pod": "clipforge-worker-0"}]}
    assert not teardown_guard.guard(outputs, tmp_path, False, "make down STACK=mine")
    err = capsys.readouterr().err
    assert "refusing to release the GPUs: pulumi stack output: workers[0].host missing" in err
    assert "Traceback" not in err


def test_a_bug_in_the_guard_is_no_refusal(tmp_path, monkeypatch):
    """Only user errors are "cannot decide": a bug leaves guard() as itself, even with FORCE."""

    def bug(*args, **kwargs):
        raise KeyError("an injected bug")

    monkeypatch.setattr(teardown_guard, "parse_stack_outputs", bug)
    for force in (False, True):
        with pytest.raises(KeyError, match="an injected bug"):
            teardown_guard.guard(OUTPUTS, tmp_path, force, "make down STACK=mine")
