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
# make test's worker processes (pytest-xdist), a test file each at a time: its module's fixtures
# are built once. 2 keeps both cores of a small machine busy while a test waits on sshd or DVC.
TEST_WORKERS ?= 2

.PHONY: help env img2dataset-env demo test test-system test-tier2 test-tier3 lint format clean-outputs bench-wheels

# make up / down / preview (Pulumi, infra/)
include infra/infra.mk

# Every target a user runs carries a `## what it does` comment on its rule line: `make help`
# lists them, from this file and the files it includes.
# The image's name in a description is expanded here (awk reads the text, not make's values).
help:  ## this list
	@awk -F':[^#]*## ' '/^[a-zA-Z0-9_-]+:[^=]*## /{printf "%s %-16s %s\n", "make", $$1, $$2}' $(MAKEFILE_LIST) \
		| sed -e 's|$$(IMAGE_REPOSITORY)|$(IMAGE_REPOSITORY)|g' -e 's|$$(IMAGE_TAG)|$(IMAGE_TAG)|g' \
		-e 's|$$(REGISTRY)|REGISTRY|g'

# pip runs quietly; a line before each long phase says what it does and how long it takes, so
# that minutes without output do not read as a hang.
$(ENV_STAMP): pyproject.toml scripts/setup-system.sh
	scripts/setup-system.sh numactl
	scripts/need-disk.sh 8 . "$(VENV) (torch's 5.5 GB build, DeepSpeed, the tools)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[env 1/4] pip, setuptools, wheel (seconds)"
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	@echo "[env 2/4] torch, torchvision: about 2.5 GB to download (minutes; 1-2 on a fast link)"
	$(PY) -m pip install --quiet $(TORCH_PINS)
	# DeepSpeed builds from source against the installed torch: no build isolation.
	@echo "[env 3/4] clipforge, DeepSpeed (built from source), DVC, the tools (2-4 minutes)"
	$(PY) -m pip install --quiet --no-build-isolation -e '.[dev]'
	# Compile DeepSpeed's CPU communication op now, not in the first run.
	@echo "[env 4/4] DeepSpeed's CPU op, compiled once (about 2 minutes on 2 cores, silent)"
	DS_ACCELERATOR=cpu $(PY) -c "from clipforge.train.dist import prebuild_cpu_ops; prebuild_cpu_ops()"
	touch $@

env: $(ENV_STAMP)  ## only create or refresh .venv (the local CPU stack, torch 2.14.1)

$(IMG2DATASET_STAMP): scripts/setup-img2dataset.sh
	scripts/setup-img2dataset.sh $(IMG2DATASET_VENV)
	touch $@

img2dataset-env: $(IMG2DATASET_STAMP)  ## create .venv-img2dataset, the downloader of data.source: laion-parquet

# The demo is a DVC experiment run in the checkout (`dvc exp run`): DVC records its params, metrics
# and outputs (`dvc exp show`), and they stay in the workspace for `dvc plots show`, `dvc metrics
# show` and TensorBoard (logs/). Run again with nothing changed, it runs nothing and adds no second
# row of the same numbers (clipforge.repro.experiments). They are results, not code: `fab train`
# ships the commit and does not count them as uncommitted changes (clipforge.launcher.source). The
# table keeps to 80 columns: the validation loss, the test set's mean recall and the zero-shot top-1
# (every suite and the mean over suites: dvc metrics show).
RECALL_COLUMNS := 'Experiment|.*(val_loss|test.mean_recall|colour-shape.top1)$$'
# What to look at next, the activation first: make's shell had the venv, the user's has not.
DEMO_NEXT := "next, in your shell: source $(VENV)/bin/activate" \
	"  dvc metrics show           \# each suite's recall or top-1, their mean" \
	"  dvc plots show             \# the curves, in dvc_plots/index.html" \
	"  tensorboard --logdir logs  \# the same and more: http://localhost:6006/"
demo: env  ## train and evaluate the built-in default on CPU as a DVC experiment in the checkout
	scripts/setup-system.sh fonts-wqy-microhei
	source $(VENV)/bin/activate && python -m clipforge.repro.experiments \
		&& dvc exp show --no-pager --hide-workspace --drop '.*' --keep $(RECALL_COLUMNS) \
		&& printf '%s\n' $(DEMO_NEXT)

# Lint first: a style error fails `make test` in seconds, before the suite's minutes.
# The slow tier (pytest marker tier2: two hosts in network namespaces, runs moved between hosts,
# real runs killed, hung, stopped and resumed through `fab`, the whole user journey, the
# gradient-equality grid, real runs with injected faults, multi-rank and bf16 runs) is
# `make test-tier2`, which .ci/run
# runs beside this, so that `make test` stays short on 2 cores (BENCHMARKS.md). Each
# has a cheaper test here (one host with two ranks, the refused two-host launches, a run resumed
# from the store in-process, the supervisor on stand-in phases, one smoke run through `fab`).
test: env img2dataset-env lint test-system  ## lint, then the test suite but its slow tier (installs openssh-server and chromium, which tests run)
	$(PY) -m pytest -m "not tier2 and not tier3" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-system:  ## the system packages the tests run (sshd, ip netns, a CJK font, chromium)
	scripts/setup-system.sh openssh-server iproute2 fonts-wqy-microhei chromium

test-tier2: env test-system  ## the suite's slow tier: two-host runs in network namespaces, moved runs, real-run recovery, journeys
	$(PY) -m pytest -m "tier2 and not tier3" $(PYTEST_ARGS)

# Outside .ci/run, which must end within CI's 90 minutes: each is a real run of a claim a cheaper
# real run proves in make test or make test-tier2 (the marker's comment names it), or the GPU
# bench's dry run on CPU. Before a release, and before a device is lent.
test-tier3: env test-system  ## real runs that repeat a claim on two machines or nodes, the documented smoke runs, the GPU bench's dry runs (~20 min)
	$(PY) -m pytest -m tier3 $(PYTEST_ARGS)

LINTED := src infra tests fabfile.py docker bench scripts

lint: env  ## ruff check + ruff format --check + mypy on src/ (make test runs it first)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(PY) -m mypy

format: env  ## let ruff fix imports and formatting
	$(VENV)/bin/ruff check --fix $(LINTED)
	$(VENV)/bin/ruff format $(LINTED)

# The wheels bench/gpu-run.sh installs on an offline GPU machine (kept out of git).
bench-wheels: env  ## fill bench/wheels/ for bench/gpu-run.sh on an offline GPU machine
	PYTHON=$(PY) scripts/bench-wheels.sh bench/wheels

clean-outputs:  ## delete the pipeline outputs in the checkout (data, checkpoints, models, logs, metrics)
	rm -rf data checkpoints models logs metrics

include docker/docker.mk
