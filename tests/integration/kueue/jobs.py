"""TrainingJobs as the Kueue tests make and read them, with the operator tier's Cluster helper
(tests/integration/operator/conftest.py) over a Kueue namespace."""

from __future__ import annotations

from typing import Any

from tests.integration.kueue.fixtures import QUEUE_LABEL, KueueQueues
from tests.integration.operator.conftest import GROUP_VERSION, Cluster

Manifest = dict[str, Any]
# Each worker asks for 500m; the store pod for 50m (render.rendezvous.STORE_RESOURCES).
WORKER = {"requests": {"cpu": "500m", "memory": "64Mi"}}
# The first pods wait for the operator's start (its imports: ~30 s on a loaded 2-core machine).
STARTED = 120


def create_job(cluster: Cluster, name: str, *, labels: dict[str, str] | None = None,
               **spec: Any) -> Manifest:
    body = {"apiVersion": GROUP_VERSION, "kind": "TrainingJob",
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {"image": "trainer:dev", "recovery": {"mode": "Restart"},
                     "resources": WORKER, **spec}}
    return cluster.kube.request("POST", cluster.job_path(), body=body)


def workload_of(kq: KueueQueues, job: str) -> Manifest | None:
    """The Workload the operator made for `job` (owned by it)."""
    for wl in kq.workloads():
        if any(o["kind"] == "TrainingJob" and o["name"] == job
               for o in wl["metadata"].get("ownerReferences", [])):
            return wl
    return None


def all_pods(cluster: Cluster, job: str) -> dict[str, Manifest]:
    return {**cluster.pods(job), **cluster.pods(job, role="rdzv-store")}



PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


def below_its_size(kq: KueueQueues, cluster: Cluster) -> tuple[str, str, list[str]]:
    """A job of 3 workers (min 1) at a low priority admitted for 2 (partial admission: 2 of
    500m and the store's 50m fit in 1100m, a third does not), in a ClusterQueue that preempts
    lower priorities; its two workers created and running. (the queue, the high priority class,
    the workers)"""
    low = kq.make_priority_class("low", 100)
    high = kq.make_priority_class("high", 1000)
    queue = kq.make_queue(cpu="1100m", memory="8Gi",
                          preemption={"withinClusterQueue": "LowerPriority"})
    create_job(cluster, "demo", labels={QUEUE_LABEL: queue, PRIORITY_LABEL: low},
               replicas=3, minReplicas=1)
    first = ["demo-worker-0-0", "demo-worker-1-0"]
    cluster.wait_workers(first, timeout=STARTED)
    cluster.run_all("demo")
    return queue, high, first


def raise_quota(kq: KueueQueues, cpu: str) -> None:
    """The test's ClusterQueue's CPU quota set to `cpu`."""
    cq = next(p for p in kq.created if "/clusterqueues/" in p)
    current = kq.kube.get(cq)
    assert current is not None
    groups = current["spec"]["resourceGroups"]
    groups[0]["flavors"][0]["resources"] = [{"name": "cpu", "nominalQuota": cpu},
                                            {"name": "memory", "nominalQuota": "8Gi"}]
    # A merge patch, not a PUT of what was read: Kueue writes the ClusterQueue's status all
    # the while (a PUT lost that race in CI with a 409).
    kq.kube.patch(cq, {"spec": {"resourceGroups": groups}})
