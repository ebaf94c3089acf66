# elastrain developer entry points. Every target works on a fresh machine: it builds what it needs
# (Python venv, Kubernetes components, etcd, MinIO, helm) and caches builds under ~/.cache/elastrain.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
CACHE ?= $(or $(ELASTRAIN_CACHE),$(HOME)/.cache/elastrain)
UV_VERSION := 0.13.9

.PHONY: help
help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

.PHONY: venv
venv: $(STAMP)  ## create .venv with the operator, trainer and dev dependencies
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# uv links the packages from its cache (~/.cache/uv) instead of unpacking them: a fresh
	# clone's venv in ~36 s warm, where pip took ~2 min (torch's wheels are 3+ GB). Compiled to
	# bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set nothing writes .pyc later, and
	# every process that imports torch would compile it again (8.8 s instead of 2.1 s here).
	$(BIN)/pip install -q uv==$(UV_VERSION)
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[operator,trainer,dev]'
	touch $(STAMP)

.PHONY: demo
demo: venv  ## the main job: a local elastic training run on the embedded default TrainingJob, a worker lost and replaced in process
	$(BIN)/elastrain run --local --simulate-preemption --fresh

.PHONY: demo-restart
demo-restart: venv  ## the same run in Restart mode: every worker restarted, the checkpoint reloaded
	$(BIN)/elastrain run --local --simulate-preemption --fresh --recovery Restart

.PHONY: crds
crds: venv  ## regenerate crds/ from the pydantic models
	$(BIN)/python -m elastrain_operator.render.crd > crds/.trainingjobs.tmp
	mv crds/.trainingjobs.tmp crds/trainingjobs.elastrain.dev.yaml
	cp crds/*.yaml charts/elastrain/crds/
	$(BIN)/python -m elastrain_operator.render.admission > charts/elastrain/files/pod-security-warnings.yaml

.PHONY: lint
lint: venv  ## ruff, mypy (strict) and import-linter contracts
	$(BIN)/ruff check operator trainer_image tests bench
	# mypy's cache outside the repo: a fresh clone rechecks only what changed (it compares
	# each file's hash when its mtime differs; writes are atomic), ~1 s instead of ~30 s.
	$(BIN)/mypy --cache-dir $(CACHE)/mypy operator trainer_image
	$(BIN)/lint-imports

.PHONY: build-deps
build-deps:  ## build (or reuse from ~/.cache/elastrain) etcd, Kubernetes, MinIO, helm and Kueue
	bash hack/build-all.sh

.PHONY: test-unit
test-unit: venv  ## pure tests, seconds, no servers
	$(BIN)/python -m pytest tests/unit -q $(PYTEST_ARGS)

.PHONY: test
# The e2e tier is a target of its own (make test-e2e): with it, CI on a cold machine took ~74 min,
# past the 60 min it must stay under to leave CI's 90 min limit a margin. `make test-all` runs both.
# Its tests mostly wait (on servers, torchrun's rendezvous, heartbeats): with warm starts
# (tests/warmstart, launchers and the CLI included) four workers keep the machine's 2 cores
# 60-70% busy (2026-12-05: ~1,150 s of CPU in a 13-16 min run, so the run is bound by the
# tests' waits, not the CPU). TEST_WORKERS pytest-xdist workers share them, each
# with its own servers (tests/conftest.py); worksteal evens out modules of very different
# lengths.
TEST_WORKERS ?= 4
XDIST = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal,)
test: venv lint build-deps  ## what CI runs: lint + the unit and integration tiers against real servers and torchrun
	$(BIN)/python -m pytest tests -q --ignore=tests/e2e $(XDIST) $(PYTEST_ARGS)

.PHONY: test-durations
TIER ?= test
test-durations: venv lint build-deps  ## make test (or TIER=e2e: the e2e tier) with a per-module and per-test time breakdown and the CPU's busy share
	@if [ "$(TIER)" = e2e ]; then $(MAKE) e2e-deps && $(BIN)/python -m tests.durations run -- tests/e2e -q $(PYTEST_ARGS); \
	else $(BIN)/python -m tests.durations run -- tests -q --ignore=tests/e2e $(XDIST) $(PYTEST_ARGS); fi

.PHONY: test-all
test-all: test test-e2e  ## make test, then the e2e tier on a real node (root)

.PHONY: test-operator
test-operator: venv build-deps  ## operator unit + integration tests (real apiserver)
	$(BIN)/python -m pytest tests/unit/operator tests/integration/operator tests/integration/test_crd_admission.py -q $(PYTEST_ARGS)

.PHONY: test-trainer
test-trainer: venv build-deps  ## trainer unit + integration tests (real torchrun, real MinIO)
	$(BIN)/python -m pytest tests/unit/trainer tests/integration/trainer tests/integration/cli -q $(PYTEST_ARGS)

.PHONY: bench
bench: venv build-deps  ## benchmarks; each prints ratios measured side by side in one run
	$(BIN)/python bench/checkpoint_s3.py
	$(BIN)/python bench/token_dataset.py
	$(BIN)/python bench/storage_backends.py
	$(BIN)/python bench/checkpoint_path.py

.PHONY: bench-token-shards
bench-token-shards: venv build-deps  ## sharded token data: open time and samples/s for 1, 10, 100 shards vs one file on MinIO (~3 min here)
	$(BIN)/python bench/token_shards.py $(BENCH_ARGS)

.PHONY: bench-checkpoint
bench-checkpoint: venv build-deps  ## checkpoint save+load: elastrain vs stock DCP over s3fs vs the boto3 ceiling, gpt-100m and gpt-350m, async stall (~18 min here)
	$(BIN)/python bench/checkpoint_path.py $(BENCH_ARGS)

.PHONY: bench-goodput
bench-goodput: venv  ## goodput, steps lost and recovery under repeated SIGTERM/SIGKILL of a local worker (~25 min here)
	$(BIN)/python bench/goodput.py $(BENCH_ARGS)

.PHONY: bench-operator
bench-operator: venv build-deps  ## the operator at scale: 1000 jobs x 4 workers vs a plain client, churn, idle, peering (tier A+; ~15 min here)
	$(BIN)/python bench/operator_scale.py $(BENCH_ARGS)

.PHONY: bench-recovery-node
bench-recovery-node: venv build-deps  ## recovery on the real node, Restart vs InProcess mode: worker pods evicted and SIGKILLed one at a time, p50/max per mode and the ratio (root; 7 min here with the images cached)
	$(BIN)/python bench/recovery_node.py $(BENCH_ARGS)

.PHONY: bench-kueue-node
bench-kueue-node: venv build-deps  ## Kueue preemption on the real node: eviction -> quota free, steps lost vs a plain suspend's, back to training (root; ~15 min here with the images cached)
	$(BIN)/python bench/kueue_node.py $(BENCH_ARGS)

TORCHFT_PYTHON ?= /tmp/tfv/bin/python
.PHONY: bench-inprocess
bench-inprocess: venv  ## in-process regroup + peer state transfer vs torchft (TORCHFT_PYTHON, a venv of its own) vs the restart path (~7 min here)
	$(BIN)/python bench/inprocess_regroup.py --torchft-python $(TORCHFT_PYTHON) $(BENCH_ARGS)

TIER ?= a+
.PHONY: cluster-up
cluster-up: venv build-deps  ## start a cluster and MinIO for humans: TIER=a+ (loopback, fake node) or TIER=node (a real kubelet node, root)
	$(BIN)/python hack/cluster.py up --tier $(TIER) --build

.PHONY: images-local
images-local:  ## build the pause, operator and trainer images here, without Docker or a registry (buildah; cached by input hash)
	$(PY) -m hack.images build pause operator trainer

.PHONY: test-e2e
test-e2e: venv e2e-deps  ## the e2e tier: a real one-node cluster (root), the chart, real pods (builds what it needs; ~29 min warm, ~32 when the images are rebuilt)
	ELASTRAIN_WARM_START=0 $(BIN)/python -m pytest tests/e2e -q $(PYTEST_ARGS)

# Built before pytest starts: a cold build of the node's binaries takes longer than one test's
# timeout on 2 cores, and the first test to need them would be killed mid-build.
.PHONY: e2e-deps
e2e-deps: venv build-deps  ## build (or reuse) what the e2e tier adds: kubelet, kube-proxy, CoreDNS, kube-router and the node's images
	bash hack/build-all.sh node coredns kube-router
	$(BIN)/python -m hack.images build pause operator trainer torch

.PHONY: cluster-down
cluster-down:  ## stop what cluster-up started
	$(BIN)/python hack/cluster.py down

.PHONY: clean
clean:  ## remove build outputs in the repo (caches in ~/.cache/elastrain stay)
	rm -rf build dist .mypy_cache .ruff_cache .pytest_cache runs

# --- chart, images, kind (docs/packaging.md) ---------------------------------------------
HELM ?= $(shell command -v helm 2>/dev/null || bash hack/get-helm.sh)
KIND ?= kind
DOCKER ?= docker
KIND_CLUSTER ?= elastrain
KUBECTL_KIND = kubectl --context kind-$(KIND_CLUSTER)
IMAGE_TAG ?= dev
OPERATOR_IMAGE ?= elastrain/operator
TRAINER_IMAGE ?= elastrain/trainer
TORCH_VARIANT ?= cpu

.PHONY: chart-crds
chart-crds:  ## copy crds/*.yaml into the chart (tests require byte-identical copies)
	cp crds/*.yaml charts/elastrain/crds/

.PHONY: chart-lint
chart-lint:  ## helm lint --strict with the defaults and every ci values file
	$(HELM) lint --strict charts/elastrain
	for f in charts/elastrain/ci/*.yaml; do $(HELM) lint --strict charts/elastrain -f $$f || exit 1; done

.PHONY: test-chart
test-chart: venv build-deps  ## chart, examples, RBAC and dashboard tests (real apiserver, real Prometheus)
	$(BIN)/python -m pytest tests/unit/chart tests/integration/chart -q $(PYTEST_ARGS)

.PHONY: images
images:  ## build the operator and trainer images with Docker (TORCH_VARIANT=cpu|cu128)
	$(DOCKER) build -t $(OPERATOR_IMAGE):$(IMAGE_TAG) .
	$(DOCKER) build -f trainer_image/Dockerfile --build-arg TORCH_VARIANT=$(TORCH_VARIANT) -t $(TRAINER_IMAGE):$(IMAGE_TAG) .

.PHONY: kind-up
kind-up:  ## create the kind cluster of kind-config.yaml (Docker, kind >= 0.20)
	$(KIND) get clusters | grep -qx $(KIND_CLUSTER) || $(KIND) create cluster --name $(KIND_CLUSTER) --config kind-config.yaml --wait 120s

.PHONY: kind-images
kind-images: images  ## build both images and load them into the kind nodes (no registry)
	$(KIND) load docker-image --name $(KIND_CLUSTER) $(OPERATOR_IMAGE):$(IMAGE_TAG) $(TRAINER_IMAGE):$(IMAGE_TAG)

.PHONY: kind-install
kind-install:  ## apply the CRDs and install/upgrade the chart into elastrain-system
	$(KUBECTL_KIND) apply --server-side --force-conflicts -f charts/elastrain/crds/
	$(HELM) upgrade --install elastrain charts/elastrain --kube-context kind-$(KIND_CLUSTER) \
	  --namespace elastrain-system --create-namespace --wait --timeout 3m \
	  --set image.repository=$(OPERATOR_IMAGE) --set-string image.tag=$(IMAGE_TAG) --set image.pullPolicy=Never

.PHONY: kind-minio
kind-minio:  ## MinIO, the bucket and the example's credentials Secret
	$(KUBECTL_KIND) apply -f examples/kind/minio.yaml
	$(KUBECTL_KIND) -n minio rollout status deployment/minio --timeout=180s
	$(KUBECTL_KIND) -n minio wait --for=condition=complete job/make-bucket --timeout=180s

.PHONY: kind-example
kind-example:  ## run the CPU gloo TrainingJob (drain elastrain-worker2 to play a preemption)
	$(KUBECTL_KIND) apply -f examples/kind/cpu-gloo.yaml
	$(KUBECTL_KIND) -n elastrain-demo get tj cpu-gloo -o wide

.PHONY: kind-demo
kind-demo: kind-up kind-images kind-install kind-minio kind-example  ## all of the above

.PHONY: kind-down
kind-down:  ## delete the kind cluster
	$(KIND) delete cluster --name $(KIND_CLUSTER)
