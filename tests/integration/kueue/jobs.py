"""TrainingJobs as the Kueue tests make and read them, with the operator tier's Cluster helper
(tests/integration/operator/conftest.py) over a Kueue namespace."""

from __future__ import annotations

from typing import Any

from tests.integration.kueue.fixtures import KueueQueues
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


