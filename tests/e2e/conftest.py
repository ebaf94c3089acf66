"""The e2e tier: pods really run, on the real one-node cluster hack/cluster.py starts with
`--tier node` (kubelet, containerd, kube-proxy, CoreDNS; MinIO on the pod bridge) and the
project's own images (hack/images). Every test here is marked `e2e`.

- `node`: the cluster, started once per session (root; builds missing binaries and images);
- `operator`: the Helm chart installed with the operator image, running as a pod, in namespaced
  mode: it watches (and holds Roles in) only the session's pool of job namespaces;
- `job_namespace`: a namespace of that pool, clean, with the checkpoint credentials Secret.

The job namespaces enforce the `restricted` Pod Security level (the apiserver's own PodSecurity
admission): every pod the operator or a test creates there must be hardened (`restricted_pod`
in support.py builds the tests' own). A namespaced operator's namespaces are fixed at install
time, so the pool is created before the install, named per session (a reused cluster or MinIO
never hands a test another session's leftovers), and each namespace is emptied when a test
gives it back; tests take them in turn, so the cleanup runs while other tests do.

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
# Starts Kueue and restarts the operator so that it follows Kueue: after every other test.
KUEUE_TESTS = "test_kueue.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.e2e)
    # Only one real node may run on a machine, and the session fixture keeps its node up to the
    # end: the tests that start and stop nodes of their own must run before any other takes it.
    def place(item: pytest.Item) -> int:
        name = Path(str(item.fspath)).name
        return 0 if name == HARNESS_TESTS else 2 if name == KUEUE_TESTS else 1
    items.sort(key=place)


@dataclass(frozen=True)
class SecondNode:
    """Node 2 added to a running cluster (hack/node/second.py), and its fault knobs."""

    cluster: NodeCluster
    name: str
    ip: str
    ready_seconds: float  # from the call to node 2 Ready (images in its store included)

    def _state(self) -> Any:
        state = cluster.State.load(self.cluster.dir.resolve())
        assert state is not None, self.cluster.dir
        return state

    def partition(self) -> None:
        """Every packet to and from node 2 dropped on the host's end of its link (tc)."""
        from hack.node import second

        second.partition()

    def heal(self) -> None:
        from hack.node import second

        second.heal()

    def stop_runtime(self) -> None:
        """Node 2's kubelet and containerd stopped; its containers keep running."""
        from hack.node import second

        second.stop_runtime(self._state())

    def start_runtime(self) -> None:
        """Both started again; returns once node 2 is Ready."""
        from hack.node import second

        second.start_runtime(self._state())

    def down(self) -> None:
        cluster.down_second_node(self.cluster.dir)


@contextlib.contextmanager
def added_second_node(node: NodeCluster, images: tuple[str, ...] = ("pause", "operator"),
                      ) -> Iterator[SecondNode]:
    """Node 2 joined to the running `node` cluster, removed afterwards (host cleaned). Only the
    `images` named are imported into its own containerd (the trainer's is ~5 GB)."""
    from hack.node import second_config

    started = time.monotonic()
    archives: dict[str, tuple[str, Path]] = cluster.node_images(images)
    cluster.up_second_node(node.dir, images=archives, die_with_parent=True)
    ready = time.monotonic() - started
    print(f"\nnode 2 ready in {ready:.0f} s", file=sys.stderr)
    try:
        yield SecondNode(node, second_config.NAME, second_config.NODE_IP, ready)
    finally:
        cluster.down_second_node(node.dir)


@pytest.fixture(scope="module")
def second_node(node: NodeCluster) -> Iterator[SecondNode]:
    """Opt-in: a second real node for the module's tests, in namespaces of its own (network,
    mount, cgroup root; tests/README.md), on the session's cluster; removed after the module."""
    with added_second_node(node) as added:
        yield added


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
    when missing: cached after the first time. `make test-e2e` builds them before pytest starts
    (cold, they take longer than one test's timeout); this covers a bare `pytest tests/e2e`."""
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


def operator_values(node: NodeCluster, watch: tuple[str, ...] = ()) -> list[str]:
    repository, _, tag = node.images["operator"].rpartition(":")
    # --set-string: a content hash may be all digits (seen: 927317842823), which --set reads as
    # an integer and the chart's schema refuses.
    return ["--set", f"image.repository={repository}", "--set-string", f"image.tag={tag}",
            "--set", "image.pullPolicy=Never",
            *[arg for ns in watch for arg in ("--set", f"operator.watchNamespaces.{ns}=true")],
            # Faster loops than production's, so recoveries are measured, not waited for.
            "--set-string", "operator.extraEnv.ELASTRAIN_TIMER_INTERVAL_SECONDS=2",
            "--set-string", "operator.extraEnv.ELASTRAIN_PROGRESS_INTERVAL_SECONDS=2"]


def install_operator(node: NodeCluster, watch: tuple[str, ...] = ()) -> None:
    """The chart installed as a user would: CRDs, then the release; the operator runs as a pod
    with the chart's ServiceAccount, RBAC and restricted security context, watching `watch`
    (which must exist: the chart puts a Role in each) or, when empty, every namespace."""
    k = node.kubectl
    k("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    # Polled, with room for a loaded machine: `kubectl wait` right after the apply failed in 2
    # of 8 runs on this machine while other tests ran.
    wait_for("the TrainingJob CRD Established", lambda: k(
        "get", "crd/trainingjobs.elastrain.dev", "-o",
        "jsonpath={.status.conditions[?(@.type==\"Established\")].status}",
        check=False).stdout.strip() == "True", timeout=180)
    ensure_namespace(node, OPERATOR_NAMESPACE)
    helm(node, "upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
         "--wait", "--timeout", "3m", *operator_values(node, watch))


# The Pod Security level the job namespaces (and the operator's) enforce.
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}
POOL_SIZE = 4  # the chaos module holds one throughout; the others rotate


def ensure_namespace(node: NodeCluster, name: str) -> None:
    """`name` exists and enforces the restricted Pod Security level."""
    k = node.kubectl
    if k("get", "namespace", name, check=False).returncode != 0:
        k("create", "namespace", name)
    k("label", "--overwrite", "namespace", name, *[f"{key}={v}" for key, v in RESTRICTED.items()])


def create_job_namespace(node: NodeCluster, name: str) -> None:
    """A restricted namespace with the checkpoint credentials Secret the example job reads.
    The operator reconciles jobs only in the pool's namespaces (`job_namespace`); a namespace
    made later serves pods of a test's own (another tenant, say)."""
    k = node.kubectl
    ensure_namespace(node, name)
    wait_for(f"default ServiceAccount in {name}",
             lambda: k("get", "serviceaccount", "default", "-n", name, check=False)
             .returncode == 0, timeout=30)
    k("create", "secret", "generic", CREDENTIALS_SECRET, "-n", name,
      f"--from-literal=AWS_ACCESS_KEY_ID={node.s3.access_key}",
      f"--from-literal=AWS_SECRET_ACCESS_KEY={node.s3.secret_key}")


class NamespacePool:
    """The job namespaces the operator watches, handed out in turn, emptied when given back."""

    def __init__(self, node: NodeCluster, names: tuple[str, ...]) -> None:
        self.node, self.names = node, names
        self._next, self._held = 0, set[str]()

    def take(self) -> str:
        free = [self.names[(self._next + i) % len(self.names)] for i in range(len(self.names))]
        name = next((n for n in free if n not in self._held), None)
        assert name is not None, f"all {len(self.names)} job namespaces are taken"
        self._next = (self.names.index(name) + 1) % len(self.names)
        self._held.add(name)
        k = self.node.kubectl
        wait_for(f"{name} emptied by the previous test", lambda: not k(
            "get", "trainingjobs,pods", "-n", name, "-o", "name").stdout.strip(), timeout=180)
        return name

    def give_back(self, name: str) -> None:
        """Deletes what a test left (without waiting: `take` does); keeps the Secret, the
        default ServiceAccount and the chart's Role and RoleBinding."""
        k = self.node.kubectl
        k("delete", "trainingjobs", "--all", "-n", name, "--wait=false", check=False)
        k("delete", "pods,services,networkpolicies,events", "--all", "-n", name,
          "--wait=false", check=False)
        k("delete", "configmaps,secrets", "-n", name, "--wait=false", "--field-selector",
          f"metadata.name!=kube-root-ca.crt,metadata.name!={CREDENTIALS_SECRET}", check=False)
        self._held.discard(name)


@pytest.fixture(scope="session")
def namespace_pool(node: NodeCluster) -> Iterator[NamespacePool]:
    """The session's job namespaces, restricted, with the credentials Secret; deleted at the end."""
    session = uuid.uuid4().hex[:4]
    names = tuple(f"e2e-{session}-jobs-{i}" for i in range(POOL_SIZE))
    for name in names:
        create_job_namespace(node, name)
    yield NamespacePool(node, names)
    for name in names:
        node.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def operator(node: NodeCluster, namespace_pool: NamespacePool) -> Iterator[NodeCluster]:
    """The chart in namespaced mode, watching exactly the pool's namespaces."""
    install_operator(node, watch=namespace_pool.names)
    yield node
    for name in namespace_pool.names:  # while the operator still runs to finish them
        node.kubectl("delete", "trainingjobs", "--all", "-n", name, "--wait=false", check=False)
    helm(node, "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait=false")


@pytest.fixture
def job_namespace(operator: NodeCluster, namespace_pool: NamespacePool) -> Iterator[str]:
    """A clean watched namespace with the checkpoint credentials Secret; emptied afterwards."""
    name = namespace_pool.take()
    yield name
    namespace_pool.give_back(name)
