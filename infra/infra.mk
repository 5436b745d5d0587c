# make up / make down / make preview: the Pulumi stack in infra/ (see infra/README.md).
# Written to be included from the top-level Makefile (`include infra/infra.mk`); paths are relative
# to the repository root. Usage: make up STACK=<name> [REGISTRY=<host/org>]; make down STACK=<name> [FORCE=1]

# Including this file must not make `up` the default goal of the including Makefile.
INFRA_SAVED_DEFAULT_GOAL := $(.DEFAULT_GOAL)

# Its own name: the top-level Makefile's PYTHON (python3, which creates .venv) must not replace
# the venv's interpreter, which has the project and Pulumi's SDK installed.
INFRA_PYTHON ?= .venv/bin/python
INFRA_DIR := infra
# The Pulumi project (Pulumi.yaml and the Pulumi.<stack>.yaml files); tests point it elsewhere.
PULUMI_PROJECT_DIR ?= $(INFRA_DIR)
# The outputs file the launcher reads (written atomically by make up / make down).
STACK_OUTPUTS ?= $(INFRA_DIR)/stack-outputs.json
STACK ?=
REGISTRY ?=
FORCE ?=

INFRA_STACKCTL = PYTHONPATH="$(INFRA_DIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(INFRA_PYTHON) -m clipforge_infra.stackctl \
	--stack "$(STACK)" --registry "$(REGISTRY)" --project-dir "$(PULUMI_PROJECT_DIR)" --outputs "$(STACK_OUTPUTS)"

.PHONY: up down preview

up:  ## create or update the GPU stack: make up STACK=<name> [REGISTRY=<host/org>]
	$(INFRA_STACKCTL) up

preview:  ## what make up would change: make preview STACK=<name>
	$(INFRA_STACKCTL) preview

down:  ## release the GPUs, keep volumes: make down STACK=<name> [FORCE=1]
	$(INFRA_STACKCTL) down $(if $(filter 1 yes true,$(FORCE)),--force)

.DEFAULT_GOAL := $(INFRA_SAVED_DEFAULT_GOAL)
