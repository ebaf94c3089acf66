"""Real Kueue for integration tests: the `kueue` fixture (hack/kueue.py's manager on the worker's
own apiserver, started the first time a test asks for it), Kueue namespaces, and builders for
ResourceFlavors, ClusterQueues, LocalQueues, Workloads (kueue.x-k8s.io/v1beta2) and Jobs.

tests/integration/conftest.py re-exports the fixtures, so any integration test can ask for them:

    def test_x(kueue_queues: KueueQueues) -> None:
        queue = kueue_queues.make_queue(cpu="2")          # flavor + ClusterQueue + LocalQueue
        kueue_queues.create_workload(make_workload("w", queue=queue, cpu="1"))

Only the job and pod webhooks' namespaces (`kueue_namespace`, labelled hack.kueue's
NAMESPACE_LABEL) see Kueue; every other namespace on the apiserver is as if it were not there.
`hack.kueue` imports as a namespace package: tests/conftest.py's loading of hack/cluster.py put
the repository root on sys.path.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from elastrain_operator.k8s.client import Kube, namespaced
from hack import kueue as harness
from hack.cluster_state import ClusterError
from tests.conftest import Kube as KubeFixture
from tests.conftest import cluster, fresh_namespace
from tests.integration.waiting import wait_for as wait_for

Manifest = dict[str, Any]
KUEUE = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
COHORT = "elastrain-tests"


# ------------------------------------------------------------------------------------- builders


def make_resource_flavor(name: str, node_labels: dict[str, str] | None = None) -> Manifest:
    flavor: Manifest = {"apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": name}}
    if node_labels:
        flavor["spec"] = {"nodeLabels": node_labels}
    return flavor


def make_priority_class(name: str, value: int) -> Manifest:
    return {"apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": name},
            "value": value}


def make_cluster_queue(name: str, *, flavor: str, quota: dict[str, str],
                       cohort: str | None = COHORT,
                       preemption: Manifest | None = None) -> Manifest:
    """Nominal `quota` per resource in one flavor; `namespaceSelector: {}` admits every
    namespace (left out, a ClusterQueue admits none)."""
    spec: Manifest = {
        "namespaceSelector": {},
        "resourceGroups": [{"coveredResources": sorted(quota), "flavors": [{
            "name": flavor, "resources": [{"name": resource, "nominalQuota": amount}
                                          for resource, amount in sorted(quota.items())]}]}],
    }
    if cohort:
        spec["cohortName"] = cohort
    if preemption:
        spec["preemption"] = preemption
    return {"apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": spec}


def make_local_queue(name: str, namespace: str, *, cluster_queue: str) -> Manifest:
    return {"apiVersion": KUEUE, "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue}}


def _pod_template(cpu: str) -> Manifest:
    # No kubelet runs the tier's pods: the image is never pulled.
    return {"spec": {"restartPolicy": "Never", "containers": [{
        "name": "main", "image": "elastrain/none:0", "resources": {"requests": {"cpu": cpu}}}]}}


def make_workload(name: str, *, queue: str, cpu: str, count: int = 1,
                  priority: tuple[str, int] | None = None) -> Manifest:
    """The least a controller that is not Kueue's own writes: one podSet and a queue;
    `priority`: a WorkloadPriorityClass's (name, value)."""
    spec: Manifest = {"queueName": queue, "podSets": [
        {"name": "main", "count": count, "template": _pod_template(cpu)}]}
    if priority is not None:
        spec["priorityClassRef"] = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                    "name": priority[0]}
        spec["priority"] = priority[1]
    return {"apiVersion": KUEUE, "kind": "Workload", "metadata": {"name": name}, "spec": spec}


def make_job(name: str, *, queue: str | None, cpu: str) -> Manifest:
    """A batch/v1 Job, created unsuspended: Kueue's webhook is what suspends it."""
    labels = {QUEUE_LABEL: queue} if queue else {}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": labels},
            "spec": {"suspend": False, "backoffLimit": 0, "template": _pod_template(cpu)}}


# ---------------------------------------------------------------------------------- conditions


def condition(obj: Manifest | None, kind: str) -> Manifest | None:
    for cond in (obj or {}).get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return cast(Manifest, cond)
    return None


def is_true(obj: Manifest | None, kind: str) -> bool:
    return (condition(obj, kind) or {}).get("status") == "True"


def admitted(workload: Manifest | None) -> Manifest | None:
    """The Workload once Kueue admitted it, else None (for wait_for)."""
    return workload if is_true(workload, "Admitted") else None


def tried(workload: Manifest | None) -> Manifest | None:
    """The Workload once Kueue's scheduler has tried it (QuotaReserved set either way)."""
    return workload if condition(workload, "QuotaReserved") else None


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def kueue(kube: KubeFixture, request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Kueue]:
    """Kueue's manager on this worker's apiserver, for the rest of the session."""
    version = cluster.read_versions()["KUEUE_VERSION"]
    files = harness.KueueFiles.in_cache(cluster.cache_root(), version)
    if not files.present():
        _build_kueue(request)
    try:
        state = harness.environment_for(kube.kubeconfig.parent)
    except ClusterError as err:
        pytest.skip(str(err))
    running = harness.start(state, files, tmp_path_factory.mktemp("kueue"))
    try:
        yield running
    finally:
        harness.stop_kueue(state, running)


def _build_kueue(request: pytest.FixtureRequest) -> None:
    command = "hack/build-all.sh kueue"
    if os.environ.get("ELASTRAIN_SKIP_BUILD") == "1":
        pytest.skip(f"Kueue not built and ELASTRAIN_SKIP_BUILD=1; run {command}")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    # A cold build takes minutes (hack/README.md): let its progress reach the terminal.
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\nbuilding Kueue: {command}", file=sys.stderr, flush=True)
        cluster.build(["kueue"])


@pytest.fixture
def kueue_namespace(kueue: harness.Kueue, kube: KubeFixture,
                    request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace that Kueue's job and pod webhooks see (kube_namespace's are unseen)."""
    with fresh_namespace(kube, request.node.name, {harness.NAMESPACE_LABEL: "true"}) as name:
        yield name


@dataclass
class KueueQueues:
    """Kueue objects for one test in `namespace`; the cluster-scoped ones are deleted after it
    (the namespace takes the rest with it)."""

    kube: Kube
    namespace: str
    created: list[str] = field(default_factory=list)  # API paths of cluster-scoped objects

    def _create_cluster_scoped(self, plural: str, manifest: Manifest) -> Manifest:
        path = f"/apis/{KUEUE}/{plural}"
        made = self.kube.request("POST", path, body=manifest)
        self.created.append(f"{path}/{manifest['metadata']['name']}")
        return made

    def make_queue(self, *, cpu: str, name: str = "main", cohort: str | None = COHORT,
                   memory: str | None = None, node_labels: dict[str, str] | None = None,
                   preemption: Manifest | None = None, flavor_of: str | None = None) -> str:
        """A ResourceFlavor (with `node_labels`), a ClusterQueue with `cpu` (and `memory`) of
        quota and a LocalQueue `name` over it; returns the LocalQueue's name. Cluster-scoped
        names carry the namespace's. `flavor_of`: the queue made before whose flavor this one
        uses instead (a cohort lends quota per flavor)."""
        unique = f"{self.namespace}-{name}"
        quota = {"cpu": cpu, **({"memory": memory} if memory else {})}
        flavor = f"{self.namespace}-{flavor_of}" if flavor_of else unique
        if not flavor_of:
            self._create_cluster_scoped("resourceflavors",
                                        make_resource_flavor(unique, node_labels))
        self._create_cluster_scoped("clusterqueues", make_cluster_queue(
            unique, flavor=flavor, quota=quota, cohort=cohort, preemption=preemption))
        self.kube.request("POST", namespaced(KUEUE, self.namespace, "localqueues"),
                          body=make_local_queue(name, self.namespace, cluster_queue=unique))
        return name

    def make_priority_class(self, name: str, value: int) -> str:
        """A WorkloadPriorityClass (its name carries the namespace's); returns its name."""
        unique = f"{self.namespace}-{name}"
        self._create_cluster_scoped("workloadpriorityclasses", make_priority_class(unique, value))
        return unique

    def workloads(self) -> list[Manifest]:
        return self.kube.list(namespaced(KUEUE, self.namespace, "workloads"))

    def create_workload(self, manifest: Manifest) -> Manifest:
        return self.kube.request("POST", namespaced(KUEUE, self.namespace, "workloads"),
                                 body=manifest)

    def workload(self, name: str, *, version: str = KUEUE) -> Manifest | None:
        return self.kube.get(namespaced(version, self.namespace, "workloads", name))

    def workload_of_job(self, job: str) -> Manifest | None:
        """The Workload Kueue's Job integration made for `job` (owned by it)."""
        for workload in self.kube.list(namespaced(KUEUE, self.namespace, "workloads")):
            owners = workload["metadata"].get("ownerReferences", [])
            if any(o["kind"] == "Job" and o["name"] == job for o in owners):
                return workload
        return None

    def create_job(self, manifest: Manifest) -> Manifest:
        return self.kube.request("POST", namespaced("batch/v1", self.namespace, "jobs"),
                                 body=manifest)

    def job(self, name: str) -> Manifest | None:
        return self.kube.get(namespaced("batch/v1", self.namespace, "jobs", name))

    def delete_created(self) -> None:
        for path in reversed(self.created):
            self.kube.delete(path)


@pytest.fixture
def kueue_queues(kueue: harness.Kueue, kube: KubeFixture,
                 kueue_namespace: str) -> Iterator[KueueQueues]:
    with kube.api_client() as api_client:
        queues = KueueQueues(Kube(api_client), kueue_namespace)
        try:
            yield queues
        finally:
            queues.delete_created()

