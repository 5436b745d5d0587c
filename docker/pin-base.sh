#!/usr/bin/env bash
# Resolve the base images' tags to digests and write them into pyproject.toml and
# docker/Dockerfile (`make pin-base`). Needs docker buildx and access to Docker Hub; review the
# diff and commit it. Rerun when moving to another base tag, not to follow a moving tag: the
# point of the digest is that the same tag can no longer bring different bytes.
# OFFLINE=1: no registry; the digests of the base images already pulled on this machine
# (`docker image inspect`'s RepoDigests: the registry digest they were pulled by).
set -euo pipefail
cd "$(dirname "$0")/.."
DOCKER="${DOCKER:-docker}"
PYTHON="${PYTHON:-python3}"

if [[ "${OFFLINE:-}" != 1 ]]; then
  "$DOCKER" buildx version >/dev/null 2>&1 \
    || { echo "make pin-base: error: docker buildx is not available (install the buildx plugin, or OFFLINE=1 with the bases pulled)" >&2; exit 1; }
fi

digest_of() {
  if [[ "${OFFLINE:-}" == 1 ]]; then
    local repo="${1%:*}" found
    found="$("$DOCKER" image inspect "$1" --format '{{range .RepoDigests}}{{println .}}{{end}}' 2>/dev/null \
      | grep -m1 "^${repo}@sha256:" || true)"
    [[ -n "$found" ]] || { echo "make pin-base: error: OFFLINE=1: $1 is not on this machine with a registry digest (docker load or pull it first)" >&2; exit 1; }
    echo "${found#*@}"
    return
  fi
  # The top-level digest (index or manifest): what `FROM tag@digest` resolves against.
  "$DOCKER" buildx imagetools inspect "$1" --format '{{json .Manifest}}' \
    | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["digest"])'
}

mapfile -t tags < <("$PYTHON" - <<'EOF'
import sys
sys.path.insert(0, "docker")
from pins import load_pins
pins = load_pins()
print(pins.base_devel)
print(pins.base_runtime)
EOF
)
devel="$(digest_of "${tags[0]}")"
runtime="$(digest_of "${tags[1]}")"
"$PYTHON" docker/pins.py set-digests "$devel" "$runtime"
echo "make pin-base: ${tags[0]}@$devel"
echo "make pin-base: ${tags[1]}@$runtime"
git --no-pager diff --stat -- pyproject.toml docker/Dockerfile 2>/dev/null || true
