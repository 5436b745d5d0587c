"""`make up` / `make down` / `make preview`: checks, then the Pulumi CLI, then the outputs file.

    up       select (or create) the stack, `pulumi up` with released=false, write the outputs file
    down     teardown guard (no run on the workers may lose its newest checkpoint), then `pulumi
             up` with released=true: GPU workers and TensorBoard are deleted, namespace, volumes
             and secrets stay (the stack is never destroyed)
    preview  `pulumi preview` of what `up` would do

Before calling Pulumi: the stack file exists and sets only declared keys, the kubeconfig holds the
stack's context, the Pulumi CLI is on PATH, and the SSH key is set as a secret. The image comes from
docker/image.env (plus $REGISTRY) unless the stack sets ``image``; it and ``released`` are set for
the one command and removed afterwards, so `make up` never leaves the stack file changed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from clipforge.errors import UserError
from clipforge.fsutil import atomic_write_text
from clipforge.image_env import read_image_env

from . import teardown_guard
from .contract import RUN_MODE_JOBS
from .kubeconfig import resolve_context
from .settings import SECRET_KEYS
from .stack_files import (
    is_secure,
    load_declarations,
    load_stack_values,
    program_config,
    undeclared_keys,
)

INSTALL_PULUMI = "https://www.pulumi.com/docs/iac/download-install/"
OWNED_BY_MAKE = ("released",)
EXIT_USAGE = 2  # a user error: one line, as `python -m clipforge.<stage>` exits on one


class StackctlError(UserError, RuntimeError):
    """A precondition that failed; the message says what to do."""


@dataclass(frozen=True)
class PulumiInvocation:
    """The Pulumi CLI run of one `make up/down/preview`: which stack, cluster and transient config,
    decided (and every precondition checked) before touching anything."""

    stack: str
    project_dir: Path
    context: str
    transient_config: Mapping[str, str]  # key -> value, set for this command only
    pulumi: str


def prepare_invocation(args: argparse.Namespace, environ: Mapping[str, str]) -> PulumiInvocation:
    if not args.stack:
        raise StackctlError(
            f"no stack: run `make {args.command} STACK=<name>` (stack files: "
            f"infra/Pulumi.<name>.yaml)"
        )
    declarations = load_declarations(args.project_dir)
    stack_values = load_stack_values(args.project_dir, args.stack)
    undeclared = undeclared_keys(declarations, stack_values)
    if undeclared:
        raise StackctlError(
            f"Pulumi.{args.stack}.yaml sets {', '.join(undeclared)}, which Pulumi.yaml does "
            "not declare (a typo?)"
        )
    for key in OWNED_BY_MAKE:
        if key in stack_values:
            raise StackctlError(
                f"Pulumi.{args.stack}.yaml sets {key}, which make up/down set themselves: "
                f"`pulumi -C infra config rm {key} -s {args.stack}`"
            )
    pulumi = shutil.which("pulumi", path=environ.get("PATH", ""))
    if pulumi is None:
        raise StackctlError(
            f"the Pulumi CLI is not on PATH: install it ({INSTALL_PULUMI}), then "
            "`pulumi login` (or `pulumi login --local` to keep state on this machine)"
        )
    context = resolve_context(program_config(declarations, stack_values)["kubeContext"], environ)
    if "sshAuthorizedKeys" not in stack_values:
        raise StackctlError(
            "no SSH key for the workers: `pulumi -C infra config set --secret -s "
            f"{args.stack} sshAuthorizedKeys < ~/.ssh/id_ed25519.pub`"
        )
    for key in SECRET_KEYS:
        if key in stack_values and stack_values[key] != "" and not is_secure(stack_values[key]):
            raise StackctlError(
                f"{key} is in plain text in Pulumi.{args.stack}.yaml: remove it and set it "
                f"with `pulumi -C infra config set --secret -s {args.stack} {key} ...`"
            )

    transient = {"released": "true" if args.command == "down" else "false"}
    if "image" not in stack_values:
        transient["image"] = read_image_env(args.image_env).reference(args.registry)
    return PulumiInvocation(
        stack=args.stack,
        project_dir=args.project_dir,
        context=context,
        transient_config=transient,
        pulumi=pulumi,
    )


class Pulumi:
    """The Pulumi CLI, run in the project directory against one stack."""

    def __init__(self, invocation: PulumiInvocation):
        self.invocation = invocation

    def run(self, *arguments: str, capture: bool = False) -> str:
        command = [
            self.invocation.pulumi,
            *arguments,
            "--stack",
            self.invocation.stack,
            "--cwd",
            str(self.invocation.project_dir),
        ]
        done = subprocess.run(
            command, stdout=subprocess.PIPE if capture else None, text=True, check=False
        )
        if done.returncode != 0:
            raise StackctlError(f"`pulumi {' '.join(arguments)}` failed (exit {done.returncode})")
        return done.stdout if capture else ""

    @contextmanager
    def transient_config(self) -> Iterator[None]:
        """Set the keys for one command, then remove them even if the command fails."""
        applied = []
        try:
            for key, value in self.invocation.transient_config.items():
                self.run("config", "set", key, value)
                applied.append(key)
            yield
        finally:
            for key in applied:
                self.run("config", "rm", key)


def write_outputs(outputs_json: str, path: Path, kube_context: str) -> dict:
    """Atomically replace the outputs file: the launcher never reads a half-written one.

    ``kube_context`` replaces the stack's (possibly empty) kubeContext with the context make checked,
    so the launcher keeps targeting this cluster even if kubectl's current-context changes later.
    """
    data = {**json.loads(outputs_json), "kube_context": kube_context}
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data


def cost_line(outputs: Mapping) -> str:
    cost = outputs.get("cost") or {}
    if not cost or cost.get("price_per_gpu_hour") in (None, "0"):
        return "cost: set pricePerGpuHour in the stack to see what this costs per hour"
    return (
        f"cost: {cost['gpus']} GPU(s) x {cost['price_per_gpu_hour']} {cost['currency']}/GPU-hour "
        f"= {cost['per_hour']} {cost['currency']}/hour"
    )


def access_lines(outputs: Mapping) -> list[str]:
    """How to reach the workers and TensorBoard from this machine (a jobs stack: TensorBoard
    only, its runs being Jobs that `fab train` makes)."""
    jobs = outputs.get("run_mode") == RUN_MODE_JOBS
    if outputs.get("released") or not (outputs.get("workers") or jobs):
        return []
    where = f"kubectl --context {outputs['kube_context']} -n {outputs['namespace']}"
    lines = []
    if outputs.get("workers"):
        lines.append(
            f"ssh: {where} port-forward pod/{outputs['ssh']['entry_pod']} {outputs['ssh']['port']}:"
            f"{outputs['ssh']['port']}, then ssh -p {outputs['ssh']['port']} {outputs['ssh']['user']}@127.0.0.1"
        )
    else:
        lines.append("runs: no SSH workers (runMode jobs); `fab train` makes each run a Job")
    if outputs.get("tensorboard"):
        port = outputs["tensorboard"]["port"]
        lines.append(
            f"TensorBoard: {where} port-forward svc/{outputs['tensorboard']['service']} {port}:{port}, "
            f"then http://127.0.0.1:{port}"
        )
    return lines


def run(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    invocation = prepare_invocation(args, environ)
    print(
        f"stack {invocation.stack}: context {invocation.context}; "
        + ", ".join(f"{key}={value}" for key, value in invocation.transient_config.items())
    )
    pulumi = Pulumi(invocation)
    pulumi.run("stack", "select", "--create")
    if args.command == "down":
        # Before any change: a refusal leaves the cluster exactly as it was.
        outputs = json.loads(pulumi.run("stack", "output", "--json", capture=True) or "{}")
        if not teardown_guard.guard(
            outputs, Path.cwd(), args.force, f"make down STACK={args.stack}"
        ):
            return teardown_guard.EXIT_REFUSED
    with pulumi.transient_config():
        if args.command == "preview":
            pulumi.run("preview", "--diff")
            return 0
        pulumi.run("up", "--yes", "--skip-preview")
    outputs = write_outputs(
        pulumi.run("stack", "output", "--json", capture=True), args.outputs, invocation.context
    )
    print(f"wrote {args.outputs}")
    print(cost_line(outputs))
    for line in access_lines(outputs):
        print(line)
    if args.command == "down":
        print(
            "GPU workers and TensorBoard released; namespace, volumes (datasets, checkpoints, logs) and "
            "secrets kept. `make up` re-attaches them."
        )
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    infra_dir = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(prog="stackctl", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down", "preview"))
    parser.add_argument("--stack", default="", help="stack name: infra/Pulumi.<stack>.yaml")
    parser.add_argument("--registry", default="", help="registry prefix of the image (REGISTRY)")
    parser.add_argument("--project-dir", type=Path, default=infra_dir)
    parser.add_argument("--image-env", type=Path, default=infra_dir.parent / "docker" / "image.env")
    parser.add_argument("--outputs", type=Path, default=infra_dir / "stack-outputs.json")
    parser.add_argument(
        "--force", action="store_true", help="down: release even if a checkpoint could be lost"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """A user error (clipforge.errors.UserError: a stack file, the kubeconfig, the Pulumi CLI, the
    teardown guard...) is one line per line of its message and exit 2; anything else is a bug and
    keeps its traceback."""
    args = parse_args(argv)
    try:
        return run(args, os.environ)
    except UserError as error:
        for line in str(error).splitlines():
            print(f"make {args.command}: {line}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
