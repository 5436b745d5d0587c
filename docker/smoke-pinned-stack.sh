#!/usr/bin/env bash
# Pinned-stack smoke: install the training image's locked Python stack (torch 2.1.2, DeepSpeed
# 0.14.5, open_clip, ... exactly as in docker/requirements.lock, on the image's Python 3.10) into
# .venv-pinned, then run data -> train -> eval of the built-in default on the CPU, one rank, and
# a run that loses one of its 2 ranks and ends on 1 (docker/smoke-pinned-shrink.sh).
#
#   make smoke-pinned           (pytest tests/docker/test_pinned_stack.py, which runs this)
#   docker/smoke-pinned-stack.sh
#   docker/smoke-pinned-stack.sh --install-only   (make pinned-env: only the environment, which
#                                 .ci/run makes while the test suite runs)
#
# What differs from the image, and why it does not matter for this check:
# - torch/torchvision come from PyPI (the CUDA 12.1 build, the same versions) instead of the base
#   image's conda build; without a GPU they run on the CPU.
# - DeepSpeed is built without prebuilt CUDA ops: on the CPU clipforge uses torch's AdamW.
# - the ranks are CPU processes on gloo, whose torch 2.1 lacks the tensor all-gather DeepSpeed
#   picks: clipforge.train.dist points DeepSpeed at its list fallback there.
# The environment is rebuilt only when the lock (or the install recipe below) changes; a rebuild
# downloads about 2.5 GB of wheels (torch's CUDA libraries are needed even to import it).
#
# Environment: PINNED_PYTHON (a Python 3.10; otherwise found on PATH or under pyenv),
# PINNED_VENV (default .venv-pinned), SMOKE_DIR (run there and keep it; default: a temp dir),
# PYTHON (>= 3.11 or with tomli, plus `packaging`: runs the helper scripts; default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") install_only=0 ;;
  --install-only) install_only=1 ;;
  *) echo "smoke-pinned: unknown argument $1 (the only one is --install-only)" >&2; exit 2 ;;
esac
repo="$PWD"
PYTHON="${PYTHON:-python3}"
venv="$(realpath -m "${PINNED_VENV:-.venv-pinned}")"  # absolute: the runs below cd elsewhere
# Bump when install_env changes, so existing environments are rebuilt.
recipe="recipe-2"

mapfile -t stack_args < <("$PYTHON" docker/pins.py stack-args)
want_python="${stack_args[1]}"  # stack-args starts with: --python X.Y

find_python() {
  local candidate
  for candidate in "${PINNED_PYTHON:-}" "python$want_python" \
      "$(pyenv root 2>/dev/null)"/versions/"$want_python".*/bin/python"$want_python"; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c "import sys; assert sys.version.startswith('$want_python.')" 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

install_env() {
  local python="$1" parts="$scratch/lock-parts"
  mkdir -p "$parts"
  echo "smoke-pinned: creating $venv with $("$python" --version) (torch from PyPI: ~2.5 GB)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # Everything but DeepSpeed first: its setup.py imports torch (and needs --no-build-isolation).
  "$PYTHON" docker/lockfile.py docker/requirements.lock --exclude deepspeed >"$parts/wheels.txt"
  "$PYTHON" docker/lockfile.py docker/requirements.lock --only deepspeed >"$parts/deepspeed.txt"
  "$venv/bin/python" -m pip install --quiet --no-deps --require-hashes --use-pep517 \
    -r "$parts/wheels.txt"
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$venv/bin/python" -m pip install --quiet --no-deps \
    --require-hashes --no-build-isolation --use-pep517 --no-binary deepspeed -r "$parts/deepspeed.txt"
  # The lock must be a complete, consistent closure: pip check proves it (the installs above
  # used --no-deps, so nothing else filled a gap).
  "$venv/bin/python" -m pip check
  # DeepSpeed's CPU backend JIT-compiles a shared-memory op on first use (minutes): do it here.
  PYTHONPATH="$repo/src" DS_ACCELERATOR=cpu "$venv/bin/python" -c \
    "from clipforge.train.dist import prebuild_cpu_ops; prebuild_cpu_ops()"
}

if [ -n "${SMOKE_DIR:-}" ]; then
  scratch="$SMOKE_DIR"
  mkdir -p "$scratch"
else
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/clipforge-smoke-pinned.XXXXXX")"
  trap 'rm -rf "$scratch"' EXIT
fi

python="$(find_python)" || {
  echo "smoke-pinned: no Python $want_python found (the image's Python): install one (e.g. pyenv install $want_python) or set PINNED_PYTHON=/path/to/python$want_python" >&2
  exit 1
}
stamp="$venv/.clipforge-pinned"
want_stamp="$recipe $(sha256sum docker/requirements.lock | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want_stamp" ]; then
  started=$SECONDS
  install_env "$python"
  echo "$want_stamp" >"$stamp"
  echo "smoke-pinned: environment ready in $((SECONDS - started)) s"
fi
[ "$install_only" = 1 ] && exit 0

work="$scratch/project"
rm -rf "$work"
mkdir -p "$work"
cp params.yaml "$work/"
cd "$work"
# The built-in default, shrunk to seconds: the same code paths as `make demo`.
overrides=(
  --set data.num_train=192 --set data.num_val=32 --set data.num_test_images=24
  --set data.image_size=32 --set data.samples_per_shard=50 --set model.image_size=32
  --set train.device=cpu --set train.global_batch_size=32 --set train.micro_batch_size=16
  --set train.epochs=1 --set train.warmup_steps=2 --set train.num_workers=0
  --set train.save_every_steps=3 --set train.log_every_steps=2
  --set eval.device=cpu --set eval.batch_size=64
)
run() {
  echo "smoke-pinned: $*"
  PYTHONPATH="$repo/src" DS_ACCELERATOR=cpu "$venv/bin/python" "$@"
}
started=$SECONDS
run "$repo/docker/check_stack.py" "${stack_args[@]}"
# The locked libraries the stages import only for some params (HF text towers, LAION shards).
run -c "import transformers, open_clip.hf_model, webdataset, clipforge.model.text_towers"
run -m clipforge.data "${overrides[@]}"
run -m clipforge.train "${overrides[@]}"
run -m clipforge.eval "${overrides[@]}"
"$repo/docker/smoke-pinned-shrink.sh" "$venv" "$work" "$scratch/shrink"
echo "smoke-pinned: passed in $((SECONDS - started)) s"
