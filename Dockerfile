# syntax=docker/dockerfile:1
# The elastrain operator image: Python slim, `pip install .[operator]` only (kopf, kubernetes,
# prometheus-client; never torch), running as a non-root user on a read-only root filesystem.
#
#   docker build -t elastrain/operator:dev .
#
# PYTHON_IMAGE may name a locally built base with python3 (>= 3.11) and its venv module.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the operator distribution needs; the trainer package is left out of the context copy.
COPY pyproject.toml README.md ./
COPY operator/ operator/
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install ".[operator]" \
 && /opt/venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
 && /opt/venv/bin/python -c "import elastrain_operator, kopf, kubernetes, prometheus_client"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="elastrain-operator" \
      org.opencontainers.image.description="Kubernetes operator for elastic PyTorch training on spot capacity" \
      org.opencontainers.image.licenses="Apache-2.0"
# 65532: the conventional "nonroot" UID/GID; the chart's podSecurityContext uses the same numbers.
RUN groupadd --system --gid 65532 elastrain \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin elastrain
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 65532:65532
# 8080: kopf liveness (/healthz); 9090: Prometheus metrics.
EXPOSE 8080 9090
ENTRYPOINT ["python3", "-m", "elastrain_operator"]
