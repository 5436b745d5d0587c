#!/usr/bin/env bash
# Build the CPU image (`make image-cpu`): docker/Dockerfile.cpu on a Debian base made here with
# debootstrap, with the classic builder (no buildx needed), tagged by a hash of its inputs.
#
#   docker/build-cpu.sh            -> prints the image reference, clipforge-cpu:<IMAGE_TAG>-<hash>
#
# A second run with the same inputs finds the image and builds nothing, so tests and users can
# call it every time. The inputs: Dockerfile.cpu, this script, the lock, the pins, and the files
# the image copies. Needs root (or sudo) for debootstrap, the first time per Docker engine only.
#
# Environment: DOCKER (default docker; the engine is DOCKER_HOST's), PYTHON (>= 3.11, runs
# docker/pins.py), DEBIAN_MIRROR (default http://deb.debian.org/debian), PIP_CERT (a CA bundle
# pip must trust, e.g. a company proxy's; default: pip's own `global.cert` setting, if any).
set -euo pipefail
cd "$(dirname "$0")/.."

die() {
  echo "make image-cpu: error: $*" >&2
  exit 1
}
DOCKER="${DOCKER:-docker}"
PYTHON="${PYTHON:-python3}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
BASE_IMAGE="clipforge-base:$SUITE-minbase"
# Copied into the build context; the image needs nothing else from the repository.
CONTEXT_FILES=(docker/lockfile.py docker/requirements.lock docker/check_stack.py docker/entrypoint.sh)

command -v "$DOCKER" >/dev/null 2>&1 \
  || die "the docker CLI ('$DOCKER') is not installed: install Docker Engine (Debian: apt-get install docker.io)"
if ! engine_error="$("$DOCKER" info 2>&1 >/dev/null)"; then
  die "no Docker engine is reachable ($(printf '%s' "$engine_error" | grep -m1 -i -E 'error|cannot' || echo "'$DOCKER info' failed")): start the Docker daemon or set DOCKER_HOST"
fi
# shellcheck source=docker/image.env
. docker/image.env

# check_stack.py's arguments: the pins, but the Python of the Debian base (see docker/README.md).
mapfile -t stack_args < <("$PYTHON" docker/pins.py stack-args)
[ "${#stack_args[@]}" -gt 0 ] || die "docker/pins.py stack-args failed"
stack_args[1]=3.11
lock_sha256="$(sha256sum docker/requirements.lock | cut -d' ' -f1)"
inputs_sha256="$( (cat docker/Dockerfile.cpu "$0" "${CONTEXT_FILES[@]}"; printf '%s\n' "$SUITE" "${stack_args[@]}") | sha256sum | cut -d' ' -f1)"
ref="clipforge-cpu:$IMAGE_TAG-${inputs_sha256:0:12}"

if "$DOCKER" image inspect "$ref" >/dev/null 2>&1; then
  echo "$ref"
  exit 0
fi

if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null 2>&1 \
    || die "debootstrap is not installed (Debian: apt-get install debootstrap); it makes the base image"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  rootfs="$(mktemp -d "${TMPDIR:-/tmp}/clipforge-rootfs.XXXXXX")"
  trap '$sudo rm -rf "$rootfs"' EXIT
  echo "make image-cpu: making $BASE_IMAGE (debootstrap $SUITE from $MIRROR)" >&2
  $sudo debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 \
    || die "debootstrap failed: $(tail -n 3 "$rootfs.log")"
  rm -f "$rootfs.log"
  $sudo tar -C "$rootfs" -c . | "$DOCKER" import - "$BASE_IMAGE" >/dev/null
  $sudo rm -rf "$rootfs"
  trap - EXIT
fi

context="$(mktemp -d "${TMPDIR:-/tmp}/clipforge-cpu-context.XXXXXX")"
trap 'rm -rf "$context"' EXIT
cp "${CONTEXT_FILES[@]}" "$context/"
cp docker/Dockerfile.cpu "$context/Dockerfile"
# The build's pip trusts what this machine's pip trusts (a proxy's CA): the bundle goes along.
ca="${PIP_CERT:-$("$PYTHON" -m pip config get global.cert 2>/dev/null || true)}"
ca_arg=()
if [ -n "$ca" ] && [ -f "$ca" ]; then
  cp "$ca" "$context/pip-ca.pem"
  ca_arg=(--build-arg "PIP_CERT=/opt/clipforge/build/pip-ca.pem")
fi
echo "make image-cpu: building $ref (lock sha256 $lock_sha256)" >&2
DOCKER_BUILDKIT=0 "$DOCKER" build --network host \
  --build-arg "BASE_IMAGE=$BASE_IMAGE" \
  --build-arg "LOCK_SHA256=$lock_sha256" \
  --build-arg "CHECK_STACK_ARGS=${stack_args[*]}" \
  --build-arg "INPUTS_SHA256=$inputs_sha256" \
  --build-arg "IMAGE_TAG=$IMAGE_TAG" \
  "${ca_arg[@]}" \
  --tag "$ref" "$context" >&2
echo "$ref"
