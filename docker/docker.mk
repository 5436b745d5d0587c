# Training image targets (docker/README.md), included by the top-level Makefile: image,
# image-push, image-cpu, lock, pin-base, pinned-env, smoke-pinned, test-integration (`make help`
# says what each does).
# The image name and tag live in docker/image.env, the one place infra/ and the launcher read.

# Including this file must not make `image` the default goal of the including Makefile.
DOCKER_MK_SAVED_DEFAULT_GOAL := $(.DEFAULT_GOAL)

include docker/image.env

REGISTRY ?=
DOCKER ?= docker
# Helper scripts need Python >= 3.11 (tomllib) and `packaging`: the project venv when it exists.
IMAGE_PYTHON = $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
UV = $(if $(wildcard $(VENV)/bin/uv),$(VENV)/bin/uv,uv)

.PHONY: image image-push image-cpu lock pin-base pinned-env smoke-pinned test-integration

image:  ## build the training image $(IMAGE_REPOSITORY):$(IMAGE_TAG) with docker buildx
	@DOCKER='$(DOCKER)' PYTHON='$(IMAGE_PYTHON)' docker/build.sh build

image-push:  ## build, then push as $(REGISTRY)/$(IMAGE_REPOSITORY):$(IMAGE_TAG) (REGISTRY=...)
	@DOCKER='$(DOCKER)' PYTHON='$(IMAGE_PYTHON)' REGISTRY='$(REGISTRY)' docker/build.sh push

lock:  ## re-resolve docker/requirements.lock from pyproject.toml (uv)
	UV='$(UV)' PYTHON='$(IMAGE_PYTHON)' docker/lock.sh

pin-base:  ## resolve the base images' digests (docker buildx imagetools; OFFLINE=1: the pulled bases')
	DOCKER='$(DOCKER)' PYTHON='$(IMAGE_PYTHON)' OFFLINE='$(OFFLINE)' docker/pin-base.sh

pinned-env: env  ## only create or refresh .venv-pinned, smoke-pinned's locked stack (~7 min and 2.5 GB cold)
	PYTHON=$(PY) docker/smoke-pinned-stack.sh --install-only

# ~10 minutes and 2.5 GB on a fresh machine: not part of `make test`; .ci/run calls it.
smoke-pinned: env  ## data -> train -> eval on the image's locked stack, CPU, 1 rank (~10 min)
	CLIPFORGE_PINNED_SMOKE=1 $(PY) -m pytest tests/docker/test_pinned_stack.py $(PYTEST_ARGS)

# Prints the image reference (clipforge-cpu:<IMAGE_TAG>-<inputs hash>); builds only when needed.
image-cpu:  ## build (or find) the CPU image, the locked stack on Debian; prints its reference
	@DOCKER='$(DOCKER)' PYTHON='$(IMAGE_PYTHON)' docker/build-cpu.sh

# The launcher's docker runtime end to end: a private dockerd, the CPU image (built once, ~15 min
# cold, then cached by its inputs' hash), fab train/status/logs/stop/resume/fetch/check against it.
# Outside `make test` for the cold build's time; .ci/run calls it.
test-integration: env  ## the docker runtime against a private engine and the CPU image
	scripts/setup-system.sh openssh-server iproute2 docker.io debootstrap
	CLIPFORGE_DOCKER_TESTS=1 $(PY) -m pytest tests/launcher/test_docker_runtime.py $(PYTEST_ARGS)

.DEFAULT_GOAL := $(DOCKER_MK_SAVED_DEFAULT_GOAL)
