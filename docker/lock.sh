#!/usr/bin/env bash
# Regenerate docker/requirements.lock: the training image's exact Python stack, with hashes.
#
#   make lock            (or: docker/lock.sh)
#
# Input: pyproject.toml's base dependencies plus the extras listed in [tool.clipforge.image].extras
# (the `image` extra pins torch/torchvision/DeepSpeed). Target: the base image's Python
# ([tool.clipforge.image].python) on linux x86_64 with glibc >= 2.28, whatever machine runs this.
# Needs `uv` (in the dev extra) and access to PyPI. Rerun after any dependency change in
# pyproject.toml; tests/docker fails while the lock and pyproject disagree.
set -euo pipefail
cd "$(dirname "$0")/.."

UV="${UV:-uv}"
if ! command -v "$UV" >/dev/null 2>&1; then
  echo "lock: '$UV' not found: install uv (pip install uv; it is in the dev extra) or set UV=/path/to/uv" >&2
  exit 1
fi
PYTHON_FOR_TOML="${PYTHON:-python3}"
# One `--extra NAME` per extra named in pyproject, and the target Python version.
mapfile -t settings < <("$PYTHON_FOR_TOML" docker/pins.py lock-args)

out=docker/requirements.lock
tmp="$(mktemp "${out}.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
# uv keeps the versions already in the output file unless the input needs others (or you pass
# --upgrade / --upgrade-package NAME as arguments), so a re-lock changes only what it must.
if [ -f "$out" ]; then cp "$out" "$tmp"; fi
"$UV" pip compile pyproject.toml "${settings[@]}" \
  --python-platform x86_64-manylinux_2_28 \
  --generate-hashes \
  --custom-compile-command "make lock" \
  --quiet \
  --output-file "$tmp" \
  "$@"
chmod 644 "$tmp"
mv "$tmp" "$out"
trap - EXIT
echo "lock: wrote $out ($(grep -c '^[a-zA-Z0-9]' "$out") packages); commit it with pyproject.toml"
