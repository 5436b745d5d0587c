# clipforge: `make demo` trains and evaluates the built-in default on CPU; `make test` runs the suite.
# Both create the environment first (.venv: the local CPU stack, torch 2.14.1).

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The local CPU stack. The training image pins its own (docker/); code must run on both.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
ENV_STAMP := $(VENV)/.clipforge-env
# img2dataset (the laion-parquet downloader) lives in its own environment: see scripts/setup-img2dataset.sh
IMG2DATASET_VENV ?= .venv-img2dataset
IMG2DATASET_STAMP := $(IMG2DATASET_VENV)/.clipforge-tool
PYTEST_ARGS ?=

.PHONY: help env img2dataset-env demo test lint format clean-outputs bench-wheels

# make up / down / preview (Pulumi, infra/)
include infra/infra.mk

help:
	@echo "make demo   - create .venv, run the pipeline (dvc repro) on the built-in dataset, show metrics"
	@echo "make test   - create .venv and run the test suite"
	@echo "make lint   - ruff check + ruff format --check (make test runs it first)"
	@echo "make format - let ruff fix imports and formatting"
	@echo "make env    - only create/refresh .venv"
	@echo "make img2dataset-env - create .venv-img2dataset, the downloader of data.source: laion-parquet"
	@echo "make bench-wheels - fill bench/wheels/ for bench/gpu-run.sh on an offline GPU machine"

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

$(IMG2DATASET_STAMP): scripts/setup-img2dataset.sh
	scripts/setup-img2dataset.sh $(IMG2DATASET_VENV)
	touch $@

img2dataset-env: $(IMG2DATASET_STAMP)

demo: env
	source $(VENV)/bin/activate && dvc repro && dvc metrics show

# Lint first: a style error fails `make test` in seconds, before the suite's minutes.
test: env img2dataset-env lint
	$(PY) -m pytest $(PYTEST_ARGS)

LINTED := src infra tests fabfile.py docker bench scripts

lint: env
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

format: env
	$(VENV)/bin/ruff check --fix $(LINTED)
	$(VENV)/bin/ruff format $(LINTED)

# The wheels bench/gpu-run.sh installs on an offline GPU machine (kept out of git).
bench-wheels: env
	PYTHON=$(PY) scripts/bench-wheels.sh bench/wheels

clean-outputs:
	rm -rf data checkpoints models logs metrics

include docker/docker.mk
