# elastrain developer entry points. Every target works on a fresh machine: it builds what it needs
# (Python venv, Kubernetes components, MinIO, helm) and caches builds under ~/.cache/elastrain.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv
venv: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[operator,trainer,dev]'
	touch $(STAMP)
