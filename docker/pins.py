"""The training image's pins, read from their one source (pyproject.toml), and the checks that
docker/Dockerfile, docker/requirements.lock and docker/image.env agree with it.

pyproject.toml holds the Python requirements (base dependencies + the `image` extra, which pins
torch / torchvision / DeepSpeed) and, in [tool.clipforge.image], what is not a Python requirement:
Python and CUDA versions, the base images with their digests, the GPU architectures.

  python docker/pins.py check               every disagreement, one per line (exit 1 if any)
  python docker/pins.py lock-args           the `uv pip compile` arguments `make lock` uses
  python docker/pins.py stack-args          the docker/check_stack.py arguments for the pins
  python docker/pins.py require-digests     exit 1, saying what to do, while a digest is unset
  python docker/pins.py set-digests DEVEL RUNTIME   write sha256:... digests into pyproject.toml
                                            and docker/Dockerfile together (used by `make pin-base`)
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# lockfile is the sibling module; clipforge.fsutil and clipforge.image_env (standard library only)
# are taken from the source tree, so the script runs with any Python >= 3.10, the project's venv or
# docker.mk's python3, before the project is installed.
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "docker"), str(REPO / "src")]
import lockfile  # noqa: E402

from clipforge.fsutil import atomic_write_text  # noqa: E402
from clipforge.image_env import ImageEnvError, parse_image_env  # noqa: E402

PYPROJECT = REPO / "pyproject.toml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
LOCK = REPO / "docker" / "requirements.lock"
IMAGE_ENV = REPO / "docker" / "image.env"

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# The lock is resolved for this platform: the base images are Ubuntu (glibc >= 2.28) on x86_64.
TARGET_MARKERS = {
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


@dataclass(frozen=True)
class ImagePins:
    python: str
    cuda: str
    cudnn: str
    base_devel: str
    base_devel_digest: str  # "" until `make pin-base`
    base_runtime: str
    base_runtime_digest: str
    cuda_arch_list: str
    extras: tuple[str, ...]
    requirements: tuple[str, ...]  # base dependencies + the listed extras, as written
    excluded_requirements: tuple[
        str, ...
    ]  # the other extras (run on the user's machine), minus dev

    def exact(self, name: str) -> str:
        """The `==` version a requirement pins, e.g. exact('torch') -> '2.1.2'."""
        from packaging.requirements import Requirement

        for text in self.requirements:
            req = Requirement(text)
            if lockfile.normalize(req.name) == lockfile.normalize(name):
                pins = [s.version for s in req.specifier if s.operator == "=="]
                if len(pins) == 1:
                    return pins[0]
        raise KeyError(
            f"pyproject.toml pins no exact version of {name} for the image "
            f"(add {name}==X.Y.Z to the `image` extra)"
        )

    def base_ref(self, stage: str) -> str:
        tag, digest = (
            (self.base_devel, self.base_devel_digest)
            if stage == "devel"
            else (self.base_runtime, self.base_runtime_digest)
        )
        return f"{tag}@{digest}" if digest else tag


def load_pins(pyproject: Path = PYPROJECT) -> ImagePins:
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    table = data["tool"]["clipforge"]["image"]
    extras = data["project"].get("optional-dependencies", {})
    missing = [e for e in table["extras"] if e not in extras]
    if missing:
        raise ValueError(f"[tool.clipforge.image].extras names unknown extras {missing}")
    included = [*data["project"]["dependencies"]]
    for name in table["extras"]:
        included += extras[name]
    excluded = [
        r
        for name, reqs in extras.items()
        if name not in table["extras"] and name != "dev"
        for r in reqs
    ]
    return ImagePins(
        python=table["python"],
        cuda=table["cuda"],
        cudnn=table["cudnn"],
        base_devel=table["base_devel"],
        base_devel_digest=table["base_devel_digest"],
        base_runtime=table["base_runtime"],
        base_runtime_digest=table["base_runtime_digest"],
        cuda_arch_list=table["cuda_arch_list"],
        extras=tuple(table["extras"]),
        requirements=tuple(included),
        excluded_requirements=tuple(excluded),
    )


# --- what each file should say ---------------------------------------------------------------


def expected_dockerfile_args(pins: ImagePins) -> dict[str, str]:
    return {
        "BASE_DEVEL": pins.base_ref("devel"),
        "BASE_RUNTIME": pins.base_ref("runtime"),
        "PYTHON_VERSION": pins.python,
        "CUDA_VERSION": pins.cuda,
        "TORCH_VERSION": pins.exact("torch"),
        "TORCHVISION_VERSION": pins.exact("torchvision"),
        "DEEPSPEED_VERSION": pins.exact("deepspeed"),
        "OPEN_CLIP_VERSION": pins.exact("open_clip_torch"),
        "TORCH_CUDA_ARCH_LIST": pins.cuda_arch_list,
    }


def dockerfile_args(text: str) -> dict[str, str]:
    """ARG defaults of a Dockerfile. The same ARG with two different defaults is an error."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)=(.*?)\s*$", line)
        if not match:
            continue
        name, value = match.group(1), match.group(2)
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        if name in found and found[name] != value:
            raise ValueError(f"Dockerfile: ARG {name} has two defaults: {found[name]!r}, {value!r}")
        found[name] = value
    return found


def dockerfile_problems(pins: ImagePins, text: str) -> list[str]:
    args = dockerfile_args(text)
    return [
        f"docker/Dockerfile: ARG {name}={args.get(name, '<missing>')}, pyproject.toml says {want}"
        for name, want in expected_dockerfile_args(pins).items()
        if args.get(name) != want
    ]


def base_tag_problems(pins: ImagePins) -> list[str]:
    """The official tags encode the stack: pytorch/pytorch:<torch>-cuda<cuda>-cudnn<cudnn>-<kind>."""
    stem = f"pytorch/pytorch:{pins.exact('torch')}-cuda{pins.cuda}-cudnn{pins.cudnn}"
    problems = [
        f"[tool.clipforge.image].{key} = {tag!r}, expected {stem}-{kind}"
        for key, tag, kind in (
            ("base_devel", pins.base_devel, "devel"),
            ("base_runtime", pins.base_runtime, "runtime"),
        )
        if tag != f"{stem}-{kind}"
    ]
    problems += [
        f"[tool.clipforge.image].{key} = {digest!r} is not sha256:<64 hex>"
        for key, digest in (
            ("base_devel_digest", pins.base_devel_digest),
            ("base_runtime_digest", pins.base_runtime_digest),
        )
        if digest and not _DIGEST.match(digest)
    ]
    return problems


def lock_problems(pins: ImagePins, lock_text: str) -> list[str]:
    """Every declared requirement (for the image's platform) is in the lock at an allowed version,
    and nothing that only the user's machine needs (infra, launcher) is."""
    from packaging.requirements import Requirement

    locked = {e.name: e.version for e in lockfile.parse(lock_text)}
    env = {
        **TARGET_MARKERS,
        "python_version": pins.python,
        "python_full_version": pins.python + ".0",
    }
    problems = []
    declared = set()
    for text in pins.requirements:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = lockfile.normalize(req.name)
        declared.add(name)
        if name not in locked:
            problems.append(f"docker/requirements.lock lacks {req} (run `make lock`)")
        elif not req.specifier.contains(locked[name], prereleases=True):
            problems.append(
                f"docker/requirements.lock has {name}=={locked[name]}, pyproject.toml "
                f"asks {req} (run `make lock`)"
            )
    for text in pins.excluded_requirements:
        name = lockfile.normalize(Requirement(text).name)
        if name in locked and name not in declared:
            problems.append(
                f"docker/requirements.lock has {name}, which only a non-image extra "
                f"needs (extras in the image: {list(pins.extras)}; run `make lock`)"
            )
    return problems


def image_tag_problems(pins: ImagePins, env_text: str) -> list[str]:
    """The image tag names the stack (…-pt2.1.2-cu121-ds0.14.5), so a pin change needs a new tag."""
    try:
        tag = parse_image_env(env_text).values.get("IMAGE_TAG", "")
    except ImageEnvError as exc:
        return [str(exc)]
    want = f"-pt{pins.exact('torch')}-cu{pins.cuda.replace('.', '')}-ds{pins.exact('deepspeed')}"
    return (
        []
        if tag.endswith(want)
        else [f"docker/image.env: IMAGE_TAG={tag!r} should end with {want!r}"]
    )


def all_problems() -> list[str]:
    pins = load_pins()
    return (
        base_tag_problems(pins)
        + dockerfile_problems(pins, DOCKERFILE.read_text(encoding="utf-8"))
        + lock_problems(pins, LOCK.read_text(encoding="utf-8"))
        + image_tag_problems(pins, IMAGE_ENV.read_text(encoding="utf-8"))
    )


# --- rewriting the digests ---------------------------------------------------------------------


def with_digests(
    pyproject_text: str, dockerfile_text: str, pins: ImagePins, devel: str, runtime: str
) -> tuple[str, str]:
    """Both files with new digests (pure). Raises ValueError on a malformed digest or a file whose
    lines are not where they should be."""
    for digest in (devel, runtime):
        if not _DIGEST.match(digest):
            raise ValueError(f"not a digest: {digest!r} (expected sha256:<64 hex>)")

    def replace_one(text: str, pattern: str, line: str, where: str) -> str:
        new, count = re.subn(pattern, lambda _: line, text, flags=re.MULTILINE)
        if count != 1:
            raise ValueError(f"{where}: expected one line matching {pattern!r}, found {count}")
        return new

    for key, digest in (("base_devel_digest", devel), ("base_runtime_digest", runtime)):
        pyproject_text = replace_one(
            pyproject_text, rf'^{key} = "[^"]*"', f'{key} = "{digest}"', "pyproject.toml"
        )
    for arg, tag, digest in (
        ("BASE_DEVEL", pins.base_devel, devel),
        ("BASE_RUNTIME", pins.base_runtime, runtime),
    ):
        dockerfile_text = replace_one(
            dockerfile_text, rf"^ARG {arg}=\S*$", f"ARG {arg}={tag}@{digest}", "docker/Dockerfile"
        )
    return pyproject_text, dockerfile_text


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "check"
    pins = load_pins()
    if command == "check":
        problems = all_problems()
        for problem in problems:
            print(problem)
        return 1 if problems else 0
    if command == "lock-args":
        print("--python-version", pins.python, sep="\n")
        for extra in pins.extras:
            print("--extra", extra, sep="\n")
        return 0
    if command == "stack-args":
        print("--python", pins.python, "--cuda", pins.cuda, sep="\n")
        for option, dist in (
            ("--torch", "torch"),
            ("--torchvision", "torchvision"),
            ("--deepspeed", "deepspeed"),
            ("--open-clip", "open_clip_torch"),
        ):
            print(option, pins.exact(dist), sep="\n")
        return 0
    if command == "require-digests":
        unset = [
            tag
            for tag, digest in (
                (pins.base_devel, pins.base_devel_digest),
                (pins.base_runtime, pins.base_runtime_digest),
            )
            if not digest
        ]
        if unset:
            print(
                f"the base image digest is not pinned for {', '.join(unset)}: run `make pin-base` "
                f"(docker buildx and Docker Hub; offline, with the bases pulled or loaded: `make "
                f"pin-base OFFLINE=1`), review the diff of pyproject.toml and docker/Dockerfile, "
                f"and commit it",
                file=sys.stderr,
            )
            return 1
        return 0
    if command == "set-digests" and len(argv) == 3:
        try:
            pyproject_text, dockerfile_text = with_digests(
                PYPROJECT.read_text(encoding="utf-8"),
                DOCKERFILE.read_text(encoding="utf-8"),
                pins,
                argv[1],
                argv[2],
            )
        except ValueError as exc:
            print(f"pins.py: error: {exc}", file=sys.stderr)
            return 2
        atomic_write_text(PYPROJECT, pyproject_text)
        atomic_write_text(DOCKERFILE, dockerfile_text)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
