"""Shrink to yield against real Kueue (v0.17.0) and the real apiserver, with the operator as a
process (policy.kueue_yield): in a ClusterQueue with Kueue's default preemption policy
(withinClusterQueue Never), a Workload of a higher priority that does not fit beside a running
job waits for as long as the job runs. With the yield, the job lets the fewest workers go that
cover what the Workload lacks, tells Kueue once their pods are gone (status.reclaimablePods), and
Kueue admits the Workload; the job stays admitted and is never evicted. No kubelet: the tier's
FakeKubelet confirms deletions."""

from __future__ import annotations

import pytest

from tests.integration.kueue.fixtures import (
    QUEUE_LABEL,
    KueueQueues,
    admitted,
    condition,
    make_workload,
    wait_for,
)
from tests.integration.kueue.jobs import STARTED, create_job, workload_of
from tests.integration.operator.conftest import Cluster, Operator

pytestmark = pytest.mark.cluster
PRIORITY = "kueue.x-k8s.io/priority-class"


WORKERS = ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]


def at_full_size(kq: KueueQueues, kcluster: Cluster, *, sibling: bool = False) -> tuple[str, str]:
    """A job of 3 workers (min 1) at a low priority running in a ClusterQueue with Kueue's
    default policy (no preemption within it) and 50m left (3 workers of 500m and the store's
    50m in 1600m). `sibling`: also a ClusterQueue in its cohort with no quota of its own on
    that flavor (reclaimWithinCohort Never). (the LocalQueue for the urgent Workload, the
    high priority class)"""
    low = kq.make_priority_class("low", 100)
    high = kq.make_priority_class("high", 1000)
    queue = kq.make_queue(cpu="1600m", memory="8Gi")
    other = kq.make_queue(cpu="0", name="other", flavor_of="main") if sibling else queue
    create_job(kcluster, "demo", labels={QUEUE_LABEL: queue, PRIORITY: low},
               replicas=3, minReplicas=1)
    kcluster.wait_workers(WORKERS, timeout=STARTED)
    kcluster.run_all("demo")
    wait_for("the job Running", lambda: kcluster.status("demo").get("phase") == "Running")
    return other, high


def gave_one_back(kq: KueueQueues, kcluster: Cluster) -> str:
    """Once the urgent Workload is admitted: the job admitted, not evicted, one worker given
    back and reported, nothing counted; its YieldedQuota event's message."""
    wait_for("the urgent Workload admitted", lambda: admitted(kq.workload("urgent")),
             timeout=90)
    wl = workload_of(kq, "demo")
    assert wl is not None and admitted(wl) and condition(wl, "Evicted") is None, wl
    assert wl["status"]["reclaimablePods"] == [{"name": "workers", "count": 1}]
    assert sorted(kcluster.worker_names("demo")) == WORKERS[:2]
    status = kcluster.status("demo")
    assert (status["queue"]["admittedWorkers"], status["queue"]["yieldedWorkers"]) == (2, 1)
    assert (status["phase"], status["preemptions"], status["restarts"]) == ("Running", 0, 0)
    (event,) = kcluster.events("YieldedQuota")
    return str(event["message"])


def test_a_job_above_its_minimum_gives_a_worker_back_to_a_more_urgent_workload(
        kueue_queues: KueueQueues, kcluster: Cluster, kueue_operator: Operator) -> None:
    kq = kueue_queues
    queue, high = at_full_size(kq, kcluster)
    # Lacks 450m: one worker's 500m covers it.
    kq.create_workload(make_workload("urgent", queue=queue, cpu="500m", priority=(high, 1000)))
    message = gave_one_back(kq, kcluster)
    assert "to Workload" in message and "urgent" in message, message


def test_a_job_gives_a_worker_back_to_a_more_urgent_workload_of_its_cohort(
        kueue_queues: KueueQueues, kcluster: Cluster, kueue_operator: Operator) -> None:
    kq = kueue_queues
    # The urgent Workload waits in the sibling: it can only borrow what the job's queue leaves.
    other, high = at_full_size(kq, kcluster, sibling=True)
    kq.create_workload(make_workload("urgent", queue=other, cpu="500m", priority=(high, 1000)))
    message = gave_one_back(kq, kcluster)
    assert "in the cohort" in message and "urgent" in message, message
