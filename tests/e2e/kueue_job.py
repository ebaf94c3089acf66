"""Real Kueue on the real node: Kueue's manager beside the node's control plane (hack/kueue.py,
as the integration tier runs it), the operator restarted so that its startup probe finds Kueue's
API, and a queued job that a Workload of a higher priority preempts; used by
tests/e2e/test_kueue.py and bench/kueue_node.py.

The job is the e2e suite's (support.make_job: 3 workers, min 2, the tiny GPT, checkpoints to
MinIO) in a ClusterQueue whose CPU fits it, or the preemptor (a Workload with no pods, made as
a controller that is not Kueue's own makes one), but not both.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack import kueue as harness
from tests.conftest import cluster
from tests.e2e.conftest import OPERATOR_NAMESPACE, RELEASE, NodeCluster
from tests.e2e.support import Training, make_job, wait_for
from tests.integration.kueue.fixtures import (
    QUEUE_LABEL,
    admitted,
    make_cluster_queue,
    make_local_queue,
    make_priority_class,
    make_resource_flavor,
    make_workload,
)

PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
LOCAL_QUEUE = "main"
PREEMPTOR = "urgent"
# The ClusterQueue's CPU: the job (3 x 100m workers and its 50m store pod) fits, and so does the
# preemptor alone, but not both, nor the preemptor and the job at its minimum (2 workers: with
# 700m Kueue admitted it again at once, partially, beside the preemptor).
QUOTA_CPU, PREEMPTOR_CPU = "1", "800m"
WORKLOADS = "workloads.kueue.x-k8s.io"


def restart_operator(node: NodeCluster) -> None:
    """The operator probes for Kueue's API once, at startup."""
    k = node.kubectl
    k("rollout", "restart", f"deployment/{RELEASE}", "-n", OPERATOR_NAMESPACE)
    k("rollout", "status", f"deployment/{RELEASE}", "-n", OPERATOR_NAMESPACE, "--timeout=240s",
      timeout=250)


@contextlib.contextmanager
def kueue_running(node: NodeCluster, directory: Path) -> Iterator[harness.Kueue]:
    """Kueue installed on the node's cluster and its manager running; the operator restarted
    to follow it. The manager's webhooks are unregistered at the end (hack.kueue.stop_kueue);
    the operator still follows Kueue's API, whose CRDs stay."""
    files = harness.KueueFiles.in_cache(cluster.cache_root(),
                                        cluster.read_versions()["KUEUE_VERSION"])
    if not files.present():
        cluster.build(["kueue"])
    state = harness.environment_for(node.dir)
    running = harness.start(state, files, directory)
    try:
        restart_operator(node)
        yield running
    finally:
        harness.stop_kueue(state, running)


@dataclass(frozen=True)
class Queues:
    """A namespace's Kueue objects: a ResourceFlavor, a ClusterQueue (that preempts lower
    priorities within itself unless `preempts` is false: Kueue's default), its LocalQueue, and
    two WorkloadPriorityClasses."""

    namespace: str
    cpu: str = QUOTA_CPU
    preempts: bool = True

    @property
    def cluster_queue(self) -> str:
        return f"{self.namespace}-{LOCAL_QUEUE}"

    @property
    def low(self) -> str:
        return f"{self.namespace}-low"

    @property
    def high(self) -> str:
        return f"{self.namespace}-high"

    def create(self, node: NodeCluster) -> None:
        k = node.kubectl
        k("label", "namespace", self.namespace, f"{harness.NAMESPACE_LABEL}=true", "--overwrite")
        k.apply(make_resource_flavor(self.cluster_queue))
        preemption = {"withinClusterQueue": "LowerPriority"} if self.preempts else None
        k.apply(make_cluster_queue(self.cluster_queue, flavor=self.cluster_queue, cohort=None,
                                   quota={"cpu": self.cpu, "memory": "16Gi"},
                                   preemption=preemption))
        k.apply(make_local_queue(LOCAL_QUEUE, self.namespace, cluster_queue=self.cluster_queue))
        k.apply(make_priority_class(self.low, 100))
        k.apply(make_priority_class(self.high, 1000))

    def delete(self, node: NodeCluster) -> None:
        k, ns = node.kubectl, self.namespace
        k("delete", WORKLOADS, "--all", "-n", ns, "--wait=false", check=False)
        k("delete", "localqueues.kueue.x-k8s.io", "--all", "-n", ns, "--wait=false", check=False)
        for kind, name in (("clusterqueue", self.cluster_queue),
                           ("resourceflavor", self.cluster_queue),
                           ("workloadpriorityclass", self.low),
                           ("workloadpriorityclass", self.high)):
            k("delete", f"{kind}.kueue.x-k8s.io", name, "--wait=false", check=False)
        k("label", "namespace", ns, f"{harness.NAMESPACE_LABEL}-", check=False)


def queued_job(node: NodeCluster, queues: Queues, name: str, **spec: Any) -> dict[str, Any]:
    """The e2e job in the LocalQueue at the low priority."""
    job = make_job(name, queues.namespace, image=node.images["trainer"],
                   s3_endpoint=node.s3.endpoint_url, bucket=node.s3.bucket, **spec)
    job["metadata"]["labels"] = {QUEUE_LABEL: LOCAL_QUEUE, PRIORITY_LABEL: queues.low}
    return job


@dataclass(frozen=True)
class Preemption:
    at: float  # epoch s: the preemptor created
    freed_s: float  # -> the preemptor admitted (Kueue admits it once the job's quota is free)
    periodic: int  # the newest periodic commit's step at `at`: where a plain suspend resumes
    reached: int  # the last step the job trained before its pods stopped
    saved: int  # the newest commit's step once the pods stopped


class QueuedJob(Training):
    """A job under Kueue: its Workload, its pods, and a preemption by a Workload of `high`."""

    def workload(self) -> dict[str, Any] | None:
        for wl in self.k.json("get", WORKLOADS, "-n", self.ns)["items"]:
            if any(o["kind"] == "TrainingJob" and o["name"] == self.job
                   for o in wl["metadata"].get("ownerReferences", [])):
                return dict(wl)
        return None

    def workload_names(self) -> list[str]:
        listed = self.k.json("get", WORKLOADS, "-n", self.ns)["items"]
        return [w["metadata"]["name"] for w in listed]

    def preemptor(self) -> dict[str, Any] | None:
        found = self.k("get", WORKLOADS, PREEMPTOR, "-n", self.ns, "-o", "json", check=False)
        return dict(json.loads(found.stdout)) if found.returncode == 0 else None

    def all_pods(self) -> list[dict[str, Any]]:
        return list(self.k.json("get", "pods", "-n", self.ns, "-l",
                                f"elastrain.dev/job-name={self.job}")["items"])

    def committed(self) -> int:
        return max((int(r["step"]) for r in self.logs.events("checkpoint_saved")), default=0)

    def urgent(self, queues: Queues, cpu: str) -> tuple[float, float]:
        """A Workload of the high priority asking for `cpu`: (when it was created, seconds until
        Kueue admitted it)."""
        at = time.time()
        workload = make_workload(PREEMPTOR, queue=LOCAL_QUEUE, cpu=cpu,
                                 priority=(queues.high, 1000))
        workload["metadata"]["namespace"] = self.ns
        self.k.apply(workload)
        wait_for("the urgent Workload admitted", lambda: admitted(self.preemptor()),
                 timeout=180)
        return at, time.time() - at

    def preempt(self, queues: Queues) -> Preemption:
        """A Workload of the high priority that fits only without this job; returns once Kueue
        admitted it (so the job's pods are gone and its quota released)."""
        periodic = self.committed()
        at, freed = self.urgent(queues, PREEMPTOR_CPU)
        # The pods are gone; the last lines of their logs may still be on their way here.
        deadline = time.monotonic() + 10
        while self.committed() < self.logs.max_step() and time.monotonic() < deadline:
            time.sleep(0.5)
        return Preemption(at=at, freed_s=freed, periodic=periodic, reached=self.logs.max_step(),
                          saved=self.committed())

    def readmit(self) -> tuple[float, dict[str, Any]]:
        """The preemptor deleted: (when, the job's `resumed` record after that)."""
        self.k("delete", WORKLOADS, PREEMPTOR, "-n", self.ns)
        since = time.time()
        return since, wait_for("the resume after the readmission", lambda: next(
            (r for r in self.logs.events("resumed") if float(r["time"]) > since), None),
            timeout=300)

    def first_step_since(self, since: float) -> dict[str, Any]:
        return wait_for("a step after the resume", lambda: next(
            (r for r in self.logs.events("step") if float(r["time"]) >= since), None),
            timeout=240)
