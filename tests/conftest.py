"""Session fixtures for the real test servers that hack/cluster.py runs on loopback.

Nothing here is autouse: a unit test that asks for none of these fixtures never starts a server.

- `kube`: etcd + kube-apiserver + kube-controller-manager + kube-scheduler (tier a+) and one fake
  Ready Node, started once per session; `.kubeconfig`, `.server`, ...
- `s3`: a MinIO server with the bucket `elastrain-test`; `.endpoint_url`, `.access_key`, ...
- `kube_namespace`: a fresh namespace per test, deleted afterwards.

Missing binaries are built with hack/build-all.sh (minutes when cold, see hack/README.md) unless
ELASTRAIN_SKIP_BUILD=1, which skips the tests instead. With CI=true no test may skip: tests/ci.py's
hooks, registered here, turn every skip into a failure with its reason. ELASTRAIN_KUBECONFIG and
ELASTRAIN_S3_ENDPOINT (with ELASTRAIN_S3_ACCESS_KEY/_SECRET_KEY) reuse running servers, e.g. the
ones `eval "$(python3 hack/cluster.py up)"` started.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests import warmstart
from tests.ci import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)

ROOT = Path(__file__).resolve().parents[1]


def _load_cluster_module() -> ModuleType:
    """hack/cluster.py, imported by path (hack/ is scripts, not a package)."""
    name = "elastrain_hack_cluster"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "hack" / "cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


cluster = _load_cluster_module()


def pytest_configure(config: pytest.Config) -> None:
    """Warm starts (tests/warmstart) in each process that runs tests: not xdist's controller."""
    if config.getoption("numprocesses", default=None) and not hasattr(config, "workerinput"):
        return
    warmstart.install()


@dataclass(frozen=True)
class Kube:
    """A reachable Kubernetes API server and an admin kubeconfig for it."""

    kubeconfig: Path
    server: str
    version: str  # the pinned Kubernetes version, e.g. "1.34.10"
    tier: str  # "a+" when started here; "reused" for ELASTRAIN_KUBECONFIG
    nodes: tuple[str, ...] = ()  # fake Ready nodes the scheduler can bind pods to
    pids: dict[str, int] = field(default_factory=dict)  # server processes started here

    def api_client(self) -> Any:
        """A new kubernetes.client.ApiClient for this cluster (sets no global configuration)."""
        from kubernetes import config

        return config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig))


@dataclass(frozen=True)
class S3:
    """An S3 endpoint with credentials and an existing bucket."""

    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    region: str
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def client_kwargs(self) -> dict[str, str]:
        """Keyword arguments for boto3.client("s3", **s3.client_kwargs)."""
        return {"endpoint_url": self.endpoint_url, "aws_access_key_id": self.access_key,
                "aws_secret_access_key": self.secret_key, "region_name": self.region}


def _ensure_binaries(request: pytest.FixtureRequest, tier: str, s3: bool) -> None:
    missing = cluster.find_binaries().missing(tier, s3)
    if not missing:
        return
    command = f"hack/build-all.sh {' '.join(missing)}"
    if os.environ.get("ELASTRAIN_SKIP_BUILD") == "1":
        pytest.skip(f"test servers not built ({', '.join(missing)}) and ELASTRAIN_SKIP_BUILD=1; "
                    f"run {command}")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    # A cold build takes minutes: let its progress reach the terminal.
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\nbuilding test servers: {command}", file=sys.stderr, flush=True)
        cluster.build(missing)


def _pids(state: Any) -> dict[str, int]:
    return {proc.name: proc.pid for proc in state.procs}


def _server_of(kubeconfig: Path) -> str:
    config = yaml.safe_load(kubeconfig.read_text())
    current = config.get("current-context")
    context = next(c["context"] for c in config["contexts"] if c["name"] == current)
    return str(next(c["cluster"]["server"] for c in config["clusters"]
                    if c["name"] == context["cluster"]))


def _fake_nodes(kubeconfig: Path) -> tuple[str, ...]:
    """The Ready nodes no kubelet backs that hack/cluster.py registers (labelled so)."""
    from kubernetes import client, config

    with config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig)) as api_client:
        nodes = client.CoreV1Api(api_client).list_node(label_selector=cluster.FAKE_NODE_LABEL)
    return tuple(sorted(n.metadata.name for n in nodes.items if n.metadata and n.metadata.name))


@pytest.fixture(scope="session")
def kube(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    """Tier a+ Kubernetes for the whole session (or the one ELASTRAIN_KUBECONFIG names)."""
    version = cluster.read_versions()["K8S_VERSION"]
    reuse = os.environ.get("ELASTRAIN_KUBECONFIG")
    if reuse:
        path = Path(reuse)
        yield Kube(kubeconfig=path, server=_server_of(path), version=version, tier="reused",
                   nodes=_fake_nodes(path))
        return
    _ensure_binaries(request, "a+", s3=False)
    directory = tmp_path_factory.mktemp("kube")
    try:
        state = cluster.up(directory, tier="a+", s3=False, die_with_parent=True)
        yield Kube(kubeconfig=Path(state.kubeconfig), server=state.server, version=version,
                   tier=state.tier, nodes=tuple(cluster.FAKE_NODES), pids=_pids(state))
    finally:
        cluster.down(directory)


@pytest.fixture(scope="session")
def s3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    """MinIO with the bucket `elastrain-test` (or the endpoint ELASTRAIN_S3_ENDPOINT names)."""
    endpoint = os.environ.get("ELASTRAIN_S3_ENDPOINT")
    if endpoint:
        try:
            keys = os.environ["ELASTRAIN_S3_ACCESS_KEY"], os.environ["ELASTRAIN_S3_SECRET_KEY"]
        except KeyError as missing:
            pytest.fail(f"ELASTRAIN_S3_ENDPOINT is set but {missing} is not")
        yield S3(endpoint_url=endpoint, access_key=keys[0], secret_key=keys[1],
                 bucket=os.environ.get("ELASTRAIN_S3_BUCKET", cluster.BUCKET),
                 region=os.environ.get("ELASTRAIN_S3_REGION", cluster.REGION))
        return
    _ensure_binaries(request, "none", s3=True)
    directory = tmp_path_factory.mktemp("s3")
    try:
        state = cluster.up(directory, tier="none", s3=True, die_with_parent=True)
        yield S3(endpoint_url=state.s3_endpoint, access_key=state.s3_access_key,
                 secret_key=state.s3_secret_key, bucket=state.s3_bucket, region=state.s3_region,
                 pids=_pids(state))
    finally:
        cluster.down(directory)


def _namespace_name(test_name: str) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].rstrip("-")
    return f"t-{stem}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def kube_namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new namespace named after the test; deleted (without waiting) after it.

    On a cluster with a controller-manager it waits for the namespace's `default` ServiceAccount,
    since until then the ServiceAccount admission plugin refuses pods."""
    with fresh_namespace(kube, request.node.name) as name:
        yield name


@contextlib.contextmanager
def fresh_namespace(kube: Kube, test_name: str,
                    labels: dict[str, str] | None = None) -> Iterator[str]:
    """kube_namespace's namespace, for fixtures that need one with more `labels`."""
    from kubernetes import client

    name = _namespace_name(test_name)
    with kube.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
            name=name, labels={"elastrain.dev/test": "true", **(labels or {})})))
        if _has_service_account_controller(core):
            _wait_for_default_service_account(core, name)
        try:
            yield name
        finally:
            _confirm_unbacked_pods(core, name)
            core.delete_namespace(name, propagation_policy="Background")


def _confirm_unbacked_pods(core: Any, namespace: str) -> None:
    """Force-delete the namespace's pods bound to a node no kubelet backs (the tier's fake
    node): nothing would confirm their graceful deletion, so they would stay Terminating on it
    for the rest of the session, and past its 110 pods every new pod is Unschedulable."""
    unbacked = {n.metadata.name for n in core.list_node().items
                if not (n.status and n.status.daemon_endpoints
                        and n.status.daemon_endpoints.kubelet_endpoint
                        and n.status.daemon_endpoints.kubelet_endpoint.port)}
    for pod in core.list_namespaced_pod(namespace).items:
        if pod.spec and pod.spec.node_name in unbacked:
            with contextlib.suppress(Exception):  # already gone
                core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)


def _has_service_account_controller(core: Any) -> bool:
    accounts = core.list_namespaced_service_account("default",
                                                    field_selector="metadata.name=default")
    return bool(accounts.items)


def _wait_for_default_service_account(core: Any, namespace: str) -> None:
    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + 30
    while True:
        try:
            core.read_namespaced_service_account("default", namespace)
            return
        except ApiException as err:
            if err.status != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)
