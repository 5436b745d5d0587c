"""Check that this Python environment is the pinned stack, naming every difference.

Run by the image build (twice: on the build stage's devel base and on the final runtime base, so
a base image that drifted from its tag's promise fails the build, not a training run) and by the
pinned-stack smoke. Standard library plus the packages it checks.

  python docker/check_stack.py --python 3.10 --torch 2.1.2 --cuda 12.1 --torchvision 0.16.2 \
      [--deepspeed 0.14.5] [--open-clip 3.3.0] [--fused-adam]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys


def base_version(version: str) -> str:
    """'2.1.2+cu121' -> '2.1.2': PyPI and conda builds of one release differ only in the label."""
    return version.split("+", 1)[0]


def differences(args: argparse.Namespace) -> list[str]:
    found = []
    python = "{}.{}".format(*sys.version_info[:2])
    if python != args.python:
        found.append(f"python {python}, expected {args.python}")
    import torch

    if base_version(torch.__version__) != args.torch:
        found.append(f"torch {torch.__version__}, expected {args.torch}")
    if torch.version.cuda != args.cuda:
        found.append(f"torch built for CUDA {torch.version.cuda}, expected {args.cuda}")
    for option, dist in (
        ("torchvision", "torchvision"),
        ("deepspeed", "deepspeed"),
        ("open_clip", "open_clip_torch"),
    ):
        want = getattr(args, option)
        if want is None:
            continue
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{dist} not installed, expected {want}")
            continue
        if base_version(have) != want:
            found.append(f"{dist} {have}, expected {want}")
    if args.fused_adam:
        found += fused_adam_problems()
    return found


def fused_adam_problems() -> list[str]:
    """DeepSpeed's fused Adam must be compiled into the install (not JIT-built at start-up)
    and load here, which proves it links against this torch and CUDA runtime."""
    # No GPU is visible during a build; without this DeepSpeed would pick its CPU op builders.
    os.environ["DS_ACCELERATOR"] = "cuda"
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import FusedAdamBuilder

    if not installed_ops.get("fused_adam"):
        return [
            "deepspeed was installed without the prebuilt fused_adam op (DS_BUILD_FUSED_ADAM=1)"
        ]
    try:
        FusedAdamBuilder().load(verbose=False)
    except Exception as exc:  # any failure to load is the finding itself
        return [f"deepspeed's prebuilt fused_adam does not load: {exc}"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_stack.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True)
    parser.add_argument("--torch", required=True)
    parser.add_argument("--cuda", required=True)
    parser.add_argument("--torchvision")
    parser.add_argument("--deepspeed")
    parser.add_argument("--open-clip", dest="open_clip")
    parser.add_argument("--fused-adam", action="store_true")
    args = parser.parse_args(argv)
    found = differences(args)
    for line in found:
        print(f"check_stack: {line}", file=sys.stderr)
    if found:
        print(
            "check_stack: this environment is not the pinned stack (see pyproject.toml "
            "[tool.clipforge.image] and the `image` extra)",
            file=sys.stderr,
        )
        return 1
    print(
        f"check_stack: ok: python {args.python}, torch {args.torch} (CUDA {args.cuda})"
        + "".join(
            f", {name} {getattr(args, name)}"
            for name in ("torchvision", "deepspeed", "open_clip")
            if getattr(args, name)
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
