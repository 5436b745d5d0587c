# clipforge: `make demo` trains and evaluates the built-in default on CPU; `make test` runs the suite.
# Both create the environment first (.venv: the local CPU stack, torch 2.14.1).

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The local CPU stack. The training image pins its own (docker/); code must run on both.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
ENV_STAMP := $(VENV)/.clipforge-env
PYTEST_ARGS ?=

.PHONY: help env demo test clean-outputs

# make up / down / preview (Pulumi, infra/)
include infra/infra.mk

help:
	@echo "make demo   - create .venv, run the pipeline (dvc repro) on the built-in dataset, show metrics"
	@echo "make test   - create .venv and run the test suite"
	@echo "make env    - only create/refresh .venv"

$(ENV_STAMP): pyproject.toml scripts/setup-system.sh
	scripts/setup-system.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet $(TORCH_PINS)
	# DeepSpeed builds from source against the installed torch: no build isolation.
	$(PY) -m pip install --quiet --no-build-isolation -e '.[dev]'
	# Compile DeepSpeed's CPU communication op now (about a minute), not in the first run.
	DS_ACCELERATOR=cpu $(PY) -c "from clipforge.train.dist import prebuild_cpu_ops; prebuild_cpu_ops()"
	touch $@

env: $(ENV_STAMP)

demo: env
	source $(VENV)/bin/activate && dvc repro && dvc metrics show

test: env
	$(PY) -m pytest $(PYTEST_ARGS)

clean-outputs:
	rm -rf data checkpoints models logs metrics

include docker/docker.mk
