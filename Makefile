# elastrain developer entry points. Every target works on a fresh machine: it builds what it needs
# (Python venv, Kubernetes components, etcd, MinIO, helm) and caches builds under ~/.cache/elastrain.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help
help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

.PHONY: venv
venv: $(STAMP)  ## create .venv with the operator, trainer and dev dependencies
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[operator,trainer,dev]'
	touch $(STAMP)

.PHONY: demo
demo: venv  ## the main job: a local elastic training run on the embedded default TrainingJob
	$(BIN)/elastrain run --local

.PHONY: crds
crds: venv  ## regenerate crds/ from the pydantic models
	$(BIN)/python -m elastrain_operator.render.crd > crds/.trainingjobs.tmp
	mv crds/.trainingjobs.tmp crds/trainingjobs.elastrain.dev.yaml

.PHONY: lint
lint: venv  ## ruff, mypy (strict) and import-linter contracts
	$(BIN)/ruff check operator trainer_image tests bench
	$(BIN)/mypy operator trainer_image
	$(BIN)/lint-imports

.PHONY: build-deps
build-deps:  ## build (or reuse from ~/.cache/elastrain) etcd, Kubernetes, MinIO and helm
	bash hack/build-all.sh

.PHONY: test-unit
test-unit: venv  ## pure tests, seconds, no servers
	$(BIN)/python -m pytest tests/unit -q $(PYTEST_ARGS)

.PHONY: test
test: venv lint build-deps  ## everything CI runs: lint + every test tier against real servers
	$(BIN)/python -m pytest tests -q $(PYTEST_ARGS)

.PHONY: cluster-up
cluster-up: venv build-deps  ## start a tier A+ cluster and MinIO on loopback for humans
	$(BIN)/python hack/cluster.py up

.PHONY: cluster-down
cluster-down:  ## stop what cluster-up started
	$(BIN)/python hack/cluster.py down

.PHONY: clean
clean:  ## remove build outputs in the repo (caches in ~/.cache/elastrain stay)
	rm -rf build dist .mypy_cache .ruff_cache .pytest_cache runs
