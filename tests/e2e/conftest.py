"""The e2e tier: pods really run, on the real one-node cluster hack/cluster.py starts with
`--tier node` (kubelet, containerd, kube-proxy, CoreDNS; MinIO on the pod bridge) and the
project's own images (hack/images). Every test here is marked `e2e`.

- `node`: the cluster, started once per session (root; builds missing binaries and images);
- `operator`: the Helm chart installed with the operator image, running as a pod;
- `job_namespace`: a fresh namespace with the checkpoint credentials Secret.

Without root this tier skips, except with CI=true, where it fails with the reason (nothing may
skip in CI). ELASTRAIN_E2E_KEEP=1 leaves the cluster running after the session for a post-mortem
(`python3 hack/cluster.py down --dir <printed dir>` stops it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import S3, cluster
from tests.e2e.support import Kubectl, wait_for
from tests.unit.chart.chartlib import CHART, helm_or_skip

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "elastrain-system"
RELEASE = "elastrain"
CREDENTIALS_SECRET = "checkpoint-s3"


HARNESS_TESTS = "test_harness_node.py"  # bring their own node: before the session `node`


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.e2e)
    # Only one real node may run on a machine, and the session fixture keeps its node up to the
    # end: the tests that start and stop nodes of their own must run before any other takes it.
    items.sort(key=lambda item: Path(str(item.fspath)).name != HARNESS_TESTS)


@dataclass(frozen=True)
class NodeCluster:
    """The running real-node cluster: kubectl for it, MinIO on the bridge, the image refs."""

    dir: Path
    kubectl: Kubectl
    s3: S3
    images: dict[str, str]  # name -> ref loaded into the node's containerd
    node_ip: str


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the e2e tier cannot run: {reason}")
    pytest.skip(reason)


def require_root() -> None:
    if os.geteuid() != 0:
        _unavailable("the real node needs root (bridge, iptables, cgroups, mounts)")


def ensure_node_binaries() -> None:
    """Builds what the node tier needs beyond the control plane (kubelet, kube-proxy, CoreDNS)
    when missing: cached after the first time; the harness tests run first on a fresh machine."""
    missing = cluster.find_binaries().missing("node", True)
    if missing:
        print(f"\nbuilding: hack/build-all.sh {' '.join(missing)}", file=sys.stderr)
        cluster.build(missing)


@pytest.fixture(scope="session")
def node(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        images = prepare_node()
    reuse = os.environ.get("ELASTRAIN_E2E_CLUSTER_DIR")
    if reuse:
        yield _reused(Path(reuse), images)
        return
    keep = os.environ.get("ELASTRAIN_E2E_KEEP") == "1"
    with running_node(tmp_path_factory.mktemp("node"), images, keep=keep) as started:
        yield started


def prepare_node() -> dict[str, tuple[str, Path]]:
    """Root checked, node binaries built and the project's images built (all cached)."""
    require_root()
    ensure_node_binaries()
    started = time.monotonic()
    images = cluster.node_images()
    print(f"\nimages ready in {time.monotonic() - started:.0f} s: "
          f"{ {k: v[0] for k, v in images.items()} }", file=sys.stderr)
    return images


@contextlib.contextmanager
def running_node(directory: Path, images: dict[str, tuple[str, Path]], *,
                 keep: bool = False) -> Iterator[NodeCluster]:
    """The real-node cluster with MinIO and the images, stopped afterwards unless `keep`."""
    try:
        started = time.monotonic()
        state = cluster.up(directory, tier="node", s3=True, die_with_parent=not keep,
                           images=images)
        print(f"\nreal node ready in {time.monotonic() - started:.0f} s ({directory})",
              file=sys.stderr)
        yield _node_cluster(state, images)
    finally:
        if keep:
            print(f"\nELASTRAIN_E2E_KEEP=1: cluster left running in {directory}", file=sys.stderr)
        else:
            cluster.down(directory)


def _node_cluster(state: Any, images: dict[str, tuple[str, Path]]) -> NodeCluster:
    return NodeCluster(
        dir=Path(state.dir), kubectl=Kubectl(Path(state.kubeconfig)),
        s3=S3(endpoint_url=state.s3_endpoint, access_key=state.s3_access_key,
              secret_key=state.s3_secret_key, bucket=state.s3_bucket, region=state.s3_region),
        images={name: ref for name, (ref, _) in images.items()},
        node_ip=state.node["node_ip"])


def _reused(directory: Path, images: dict[str, tuple[str, Path]]) -> NodeCluster:
    """ELASTRAIN_E2E_CLUSTER_DIR: a node `hack/cluster.py up --tier node --dir DIR` started;
    the current images are imported into it, and it is left running afterwards."""
    state = cluster.State.load(directory.resolve())
    if state is None or state.tier != "node" or not state.running():
        pytest.fail(f"ELASTRAIN_E2E_CLUSTER_DIR={directory}: no running node cluster there")
    cluster.load_node_images(state, images)
    return _node_cluster(state, images)


def helm(node: NodeCluster, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(helm_or_skip()), "--kubeconfig", str(node.kubectl.kubeconfig),
                           *args], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done


def operator_values(node: NodeCluster) -> list[str]:
    repository, _, tag = node.images["operator"].rpartition(":")
    return ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "image.pullPolicy=Never",
            # Faster loops than production's, so recoveries are measured, not waited for.
            "--set-string", "operator.extraEnv.ELASTRAIN_TIMER_INTERVAL_SECONDS=2",
            "--set-string", "operator.extraEnv.ELASTRAIN_PROGRESS_INTERVAL_SECONDS=2"]


def install_operator(node: NodeCluster) -> None:
    """The chart installed as a user would: CRDs, then the release; the operator runs as a pod
    with the chart's ServiceAccount, RBAC and restricted security context."""
    k = node.kubectl
    k("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    k("wait", "--for=condition=Established", "--timeout=60s", "crd/trainingjobs.elastrain.dev")
    helm(node, "upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
         "--create-namespace", "--wait", "--timeout", "3m", *operator_values(node))


@pytest.fixture(scope="session")
def operator(node: NodeCluster) -> Iterator[NodeCluster]:
    install_operator(node)
    yield node
    helm(node, "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait=false")


def create_job_namespace(node: NodeCluster, name: str) -> None:
    """A namespace with the checkpoint credentials Secret the example job reads."""
    k = node.kubectl
    k("create", "namespace", name)
    wait_for(f"default ServiceAccount in {name}",
             lambda: k("get", "serviceaccount", "default", "-n", name, check=False)
             .returncode == 0, timeout=30)
    k("create", "secret", "generic", CREDENTIALS_SECRET, "-n", name,
      f"--from-literal=AWS_ACCESS_KEY_ID={node.s3.access_key}",
      f"--from-literal=AWS_SECRET_ACCESS_KEY={node.s3.secret_key}")


@pytest.fixture
def job_namespace(operator: NodeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace with the checkpoint credentials Secret; deleted afterwards."""
    k = operator.kubectl
    stem = request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    name = f"e2e-{stem}-{uuid.uuid4().hex[:4]}"
    create_job_namespace(operator, name)
    yield name
    k("delete", "trainingjobs", "--all", "-n", name, "--wait=false", check=False)
    k("delete", "namespace", name, "--wait=false", check=False)
