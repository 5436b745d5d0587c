#!/usr/bin/env bash
# Build (and push) the training image. Called by `make image` and `make image-push`.
#
#   docker/build.sh build                 -> $IMAGE_REPOSITORY:$IMAGE_TAG in the local engine
#   REGISTRY=ghcr.io/org docker/build.sh push  -> also $REGISTRY/$IMAGE_REPOSITORY:$IMAGE_TAG
#
# The name and tag come from docker/image.env, the one place infra/ and the launcher read too.
# Checks first, in the order a user can fix them: REGISTRY, docker CLI, buildx, engine, pinned
# base digests, pins agreeing, and (push) a clean git tree, since the label records the commit.
set -euo pipefail
cd "$(dirname "$0")/.."

action="${1:-}"
case "$action" in
  build) prog="make image" ;;
  push) prog="make image-push" ;;
  *) echo "usage: docker/build.sh build|push" >&2; exit 2 ;;
esac
die() {
  echo "$prog: error: $*" >&2
  exit 1
}
DOCKER="${DOCKER:-docker}"
PYTHON="${PYTHON:-python3}"
# shellcheck source=docker/image.env
. docker/image.env
local_ref="$IMAGE_REPOSITORY:$IMAGE_TAG"

if [ "$action" = push ]; then
  registry="${REGISTRY:-}"
  registry="${registry%/}"
  [ -n "$registry" ] || die "REGISTRY is not set: say where to push, e.g. 'make image-push REGISTRY=ghcr.io/your-org' (the image becomes \$REGISTRY/$local_ref)"
fi

command -v "$DOCKER" >/dev/null 2>&1 \
  || die "the docker CLI ('$DOCKER') is not installed: install Docker Engine with the buildx plugin (https://docs.docker.com/engine/install/)"
"$DOCKER" buildx version >/dev/null 2>&1 \
  || die "docker buildx is not available: install the buildx plugin (Debian/Ubuntu package docker-buildx-plugin, or https://docs.docker.com/build/install-buildx/)"
if ! engine_error="$("$DOCKER" info 2>&1 >/dev/null)"; then
  die "no Docker engine is reachable ($(printf '%s' "$engine_error" | grep -m1 -i -E 'error|cannot' || echo "'$DOCKER info' failed")): start the Docker daemon or set DOCKER_HOST"
fi
"$PYTHON" docker/pins.py require-digests || exit 1
if ! problems="$("$PYTHON" docker/pins.py check)"; then
  die "the pins disagree (fix them, or run 'make lock' after a dependency change):"$'\n'"$problems"
fi

commit="$(git rev-parse HEAD)"
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  [ "$action" = build ] || die "the git tree has uncommitted changes: commit them first, so the pushed image's revision label names the code inside it"
  commit="$commit-dirty"
fi
lock_sha256="$(sha256sum docker/requirements.lock | cut -d' ' -f1)"

echo "$prog: building $local_ref (commit $commit, lock sha256 $lock_sha256)"
"$DOCKER" buildx build \
  --platform linux/amd64 \
  --file docker/Dockerfile \
  --build-arg "LOCK_SHA256=$lock_sha256" \
  --build-arg "GIT_COMMIT=$commit" \
  --build-arg "IMAGE_TAG=$IMAGE_TAG" \
  --tag "$local_ref" \
  --load \
  .

if [ "$action" = push ]; then
  remote_ref="$registry/$local_ref"
  "$DOCKER" tag "$local_ref" "$remote_ref"
  "$DOCKER" push "$remote_ref"
  echo "$prog: pushed $("$DOCKER" image inspect --format '{{index .RepoDigests 0}}' "$remote_ref" 2>/dev/null || echo "$remote_ref")"
fi
