"""TrainingJobs under real Kueue (v0.17.0) and the real apiserver, with the operator as a process:
queued until admitted, partial admission, preemption that stops the pods and releases the quota
before Kueue admits the preemptor, cohort reclaim, deactivation and a suspend, a spec changed
while queued, the namespace's `default` LocalQueue and Kueue's pod integration. No kubelet: the
tests drive pod status as the operator tier does (FakeKubelet confirms deletions), so a
worker's save on SIGTERM is the e2e tier's to show."""

from __future__ import annotations

from typing import Any

import pytest

from elastrain_operator.k8s.client import namespaced
from tests.integration.kueue.fixtures import (
    QUEUE_LABEL,
    KueueQueues,
    admitted,
    condition,
    is_true,
    make_workload,
    tried,
    wait_for,
)
from tests.integration.kueue.jobs import STARTED, all_pods, create_job, workload_of
from tests.integration.operator.conftest import Cluster, Operator

pytestmark = pytest.mark.cluster
Manifest = dict[str, Any]
POOL = "elastrain.dev/test-pool"  # the flavors' node label


def released_and_requeued(kq: KueueQueues, cluster: Cluster, job: str) -> Manifest:
    """The job's Workload once evicted: no pod of the job left, admission cleared, requeued."""
    assert all_pods(cluster, job) == {}
    wl = workload_of(kq, job)
    assert wl is not None and wl["status"].get("admission") is None
    assert condition(wl, "Requeued")["status"] == "True"  # type: ignore[index]
    return wl


def test_a_queued_job_creates_no_pod_until_admitted_then_runs_on_the_admitted_flavor(
        kueue_queues: KueueQueues, kcluster: Cluster, kueue_operator: Operator) -> None:
    kq = kueue_queues
    queue = kq.make_queue(cpu="2", memory="8Gi", node_labels={POOL: "a"})
    blocker = kq.create_workload(make_workload("blocker", queue=queue, cpu="2"))
    wait_for("the blocker admitted", lambda: admitted(kq.workload(blocker["metadata"]["name"])))
    create_job(kcluster, "demo", labels={QUEUE_LABEL: queue}, replicas=2, minReplicas=2)
    wl = wait_for("the job's Workload tried by Kueue", lambda: tried(workload_of(kq, "demo")),
                  timeout=STARTED)
    assert condition(wl, "QuotaReserved")["status"] == "False"  # type: ignore[index]
    sets = {s["name"]: s for s in wl["spec"]["podSets"]}
    assert (sets["workers"]["count"], sets["store"]["count"]) == (2, 1)
    assert "minCount" not in sets["workers"] and "spares" not in sets
    assert wl["metadata"]["finalizers"] == ["kueue.x-k8s.io/resource-in-use"]
    assert wl["metadata"]["ownerReferences"][0]["controller"] is True
    wait_for("the job Queued", lambda: kcluster.status("demo").get("phase") == "Queued")
    # The operator has seen the Workload Kueue tried, and still created nothing.
    assert all_pods(kcluster, "demo") == {}
    assert kcluster.condition("Admitted")["reason"] == "Queued"
    # Kueue's reason reaches status.queue with the operator's next look at the Workload.
    queued = wait_for("Kueue's reason in status.queue", lambda: (
        q := kcluster.status("demo").get("queue") or {}) and (
        "insufficient" in q.get("message", "") or "quota" in q.get("message", "")) and q)
    assert (queued["name"], queued["state"]) == (queue, "Queued")
    # A spec changed while queued reaches the Workload, which holds no quota yet.
    kcluster.kube.patch(kcluster.job_path("demo"), {"spec": {"replicas": 3}})
    wait_for("the Workload asking for 3 workers", lambda: (w := workload_of(kq, "demo")) and {
        s["name"]: s["count"] for s in w["spec"]["podSets"]}["workers"] == 3)

    kq.kube.delete(namespaced("kueue.x-k8s.io/v1beta2", kq.namespace, "workloads", "blocker"))
    kcluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"],
                          timeout=STARTED)
    pods = wait_for("the store pod too", lambda: (p := all_pods(kcluster, "demo")) and
                    len(p) == 4 and p)
    for pod in pods.values():
        assert pod["spec"]["nodeSelector"][POOL] == "a", pod["metadata"]["name"]
    status = kcluster.status("demo")
    assert (status["queue"]["state"], status["queue"]["admittedWorkers"]) == ("Admitted", 3)
    assert kcluster.condition("Admitted")["status"] == "True"
    kcluster.run_all("demo")
    wait_for("PodsReady on the Workload",
             lambda: is_true(workload_of(kq, "demo"), "PodsReady") or None)


def test_partial_admission_starts_the_job_with_the_workers_that_fit(
        kueue_queues: KueueQueues, kcluster: Cluster, kueue_operator: Operator) -> None:
    kq = kueue_queues
    # Two workers and the store fit (1050m), four do not.
    queue = kq.make_queue(cpu="1100m", memory="8Gi")
    create_job(kcluster, "demo", labels={QUEUE_LABEL: queue}, replicas=4, minReplicas=2,
               maxReplicas=4)
    kcluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0"], timeout=STARTED)
    wl = workload_of(kq, "demo")
    assert wl is not None and is_true(wl, "Admitted")
    assert {s["name"]: s.get("minCount") for s in wl["spec"]["podSets"]}["workers"] == 2
    counts = {a["name"]: a.get("count") for a in wl["status"]["admission"]["podSetAssignments"]}
    assert counts["workers"] == 2
    status = wait_for("the admitted size in status", lambda: (s := kcluster.status("demo"))
                      .get("queue", {}).get("admittedWorkers") == 2 and s)
    assert status["replicas"] == 2
    assert sorted(kcluster.worker_names("demo")) == ["demo-worker-0-0", "demo-worker-1-0"]


def test_a_preempted_job_stops_releases_its_quota_and_resumes_when_admitted_again(
        kueue_queues: KueueQueues, kcluster: Cluster, kueue_operator: Operator) -> None:
    kq = kueue_queues
    low = kq.make_priority_class("low", 100)
    high = kq.make_priority_class("high", 1000)
    queue = kq.make_queue(cpu="1100m", memory="8Gi",
                          preemption={"withinClusterQueue": "LowerPriority"})
    create_job(kcluster, "demo", labels={QUEUE_LABEL: queue, "kueue.x-k8s.io/priority-class": low},
               replicas=2, minReplicas=2)
    kcluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0"], timeout=STARTED)
    wl = workload_of(kq, "demo")
    assert wl is not None and wl["spec"]["priority"] == 100
    kcluster.run_all("demo")
    wait_for("the job Running", lambda: kcluster.status("demo").get("phase") == "Running")

    kq.create_workload(make_workload("urgent", queue=queue, cpu="1", priority=(high, 1000)))
    # Kueue admits the preemptor only once the victim's quota is released, which the
    # operator does once the job's pods are gone.
    wait_for("the preemptor admitted", lambda: admitted(kq.workload("urgent")), timeout=90)
    wl = released_and_requeued(kq, kcluster, "demo")
    assert condition(wl, "Evicted")["reason"] == "Preempted"  # type: ignore[index]
    wait_for("the job Queued", lambda: kcluster.status("demo").get("phase") == "Queued")
    assert {e["reason"] for e in kcluster.events("EvictedByKueue") +
            kcluster.events("QuotaReleased")} == {"EvictedByKueue", "QuotaReleased"}

    kq.kube.delete(namespaced("kueue.x-k8s.io/v1beta2", kq.namespace, "workloads", "urgent"))
    kcluster.wait_workers(["demo-worker-0-1", "demo-worker-1-1"], timeout=60)
    status = kcluster.status("demo")
    assert (status["preemptions"], status["restarts"]) == (0, 0)
    assert status["queue"]["state"] == "Admitted"


def test_reclaimed_by_its_cohort_a_borrowing_job_stops_and_lends_the_quota_back(
        kueue_queues: KueueQueues, kcluster: Cluster, kueue_operator: Operator) -> None:
    kq = kueue_queues
    # The job's ClusterQueue has no quota of its own: it borrows the lender's, which the
    # lender takes back for a Workload of its own (Kueue's reclaimWithinCohort).
    lender = kq.make_queue(name="lender", cpu="1100m", memory="8Gi",
                           preemption={"reclaimWithinCohort": "Any"})
    borrower = kq.make_queue(name="borrower", cpu="0", memory="0", flavor_of=lender)
    create_job(kcluster, "demo", labels={QUEUE_LABEL: borrower}, replicas=2, minReplicas=2)
    kcluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0"], timeout=STARTED)
    kcluster.run_all("demo")
    kq.create_workload(make_workload("owner", queue=lender, cpu="1"))
    wait_for("the lender's Workload admitted", lambda: admitted(kq.workload("owner")), timeout=90)
    wl = released_and_requeued(kq, kcluster, "demo")
    assert condition(wl, "Preempted")["reason"] == "InCohortReclamation"  # type: ignore[index]
    evicted = kcluster.events("EvictedByKueue")
    assert evicted and "InCohortReclamation" in evicted[0]["message"], evicted
    status = kcluster.status("demo")
    assert (status["phase"], status["preemptions"], status["restarts"]) == ("Queued", 0, 0)


def test_deactivated_the_job_stops_unqueued_and_suspended_it_holds_no_quota(
        kueue_queues: KueueQueues, kcluster: Cluster, kueue_operator: Operator) -> None:
    kq = kueue_queues
    queue = kq.make_queue(cpu="1100m", memory="8Gi")
    create_job(kcluster, "demo", labels={QUEUE_LABEL: queue}, replicas=2, minReplicas=2)
    kcluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0"], timeout=STARTED)
    kcluster.run_all("demo")
    name = workload_of(kq, "demo")["metadata"]["name"]  # type: ignore[index]
    path = namespaced("kueue.x-k8s.io/v1beta2", kq.namespace, "workloads", name)

    # An administrator deactivates the Workload: the job stops, no requeue. (Kueue stops
    # counting a deactivated Workload's quota at once, while the pods still stop.)
    kq.kube.patch(path, {"spec": {"active": False}})
    wait_for("the quota released", lambda: (w := kq.workload(name)) and
             condition(w, "Requeued") and not w["status"].get("admission") and w)
    wait_for("no pod of the job left", lambda: all_pods(kcluster, "demo") == {})
    assert condition(kq.workload(name), "Requeued")["status"] == "False"  # type: ignore[index]
    wait_for("the job told why", lambda: (q := kcluster.status("demo").get("queue") or {})
             and q["state"] == "Queued" and "deactivated" in q["message"])
    assert kq.workload(name)["spec"]["active"] is False  # type: ignore[index]  # left so

    # Active again: admitted again, the pods come back.
    kq.kube.patch(path, {"spec": {"active": True}})
    kcluster.wait_workers(["demo-worker-0-1", "demo-worker-1-1"], timeout=60)
    kcluster.run_all("demo")

    # The user suspends the job: once its pods are gone the operator deactivates its Workload,
    # so the quota it held is free for another Workload while the job is suspended (and not
    # before: a deactivated Workload's quota is free at once).
    kcluster.kube.patch(kcluster.job_path("demo"), {"spec": {"suspend": True}})
    kq.create_workload(make_workload("other", queue=queue, cpu="1"))
    wait_for("the other Workload admitted in the quota the job held",
             lambda: admitted(kq.workload("other")), timeout=90)
    assert all_pods(kcluster, "demo") == {}
    wl = kq.workload(name)
    assert wl is not None and wl["spec"]["active"] is False
    assert condition(wl, "Evicted")["reason"] == "Deactivated"  # type: ignore[index]
    assert kcluster.status("demo")["phase"] == "Suspended"
    kq.kube.delete(namespaced("kueue.x-k8s.io/v1beta2", kq.namespace, "workloads", "other"))
    kcluster.kube.patch(kcluster.job_path("demo"), {"spec": {"suspend": False}})
    kcluster.wait_workers(["demo-worker-0-2", "demo-worker-1-2"], timeout=60)
    assert kq.workload(name)["spec"].get("active", True) is True  # type: ignore[index]
    status = kcluster.status("demo")
    assert (status["preemptions"], status["restarts"]) == (0, 0)


def test_the_default_local_queue_queues_new_jobs_and_kueue_leaves_their_pods_alone(
        kueue_queues: KueueQueues, kcluster: Cluster, kueue_operator: Operator) -> None:
    kq = kueue_queues
    create_job(kcluster, "before", replicas=1, minReplicas=1)  # no LocalQueue `default` yet
    kcluster.wait_workers(["before-worker-0-0"], job="before", timeout=STARTED)
    kq.make_queue(cpu="4", memory="8Gi", name="default")
    create_job(kcluster, "after", replicas=2, minReplicas=2)
    kcluster.wait_workers(["after-worker-0-0", "after-worker-1-0"], job="after", timeout=STARTED)
    # Kueue's pod integration saw a managed owner: no gate, no Workload of its own per pod.
    for pod in all_pods(kcluster, "after").values():
        assert not pod["spec"].get("schedulingGates"), pod["metadata"]["name"]
        assert "kueue.x-k8s.io/managed" not in pod["metadata"].get("labels", {})
    job = kcluster.job("after")
    assert job is not None and job["metadata"]["labels"][QUEUE_LABEL] == "default"
    wl = workload_of(kq, "after")
    assert wl is not None and wl["spec"]["queueName"] == "default"
    assert [w["metadata"]["name"] for w in kq.workloads()] == [wl["metadata"]["name"]]
    # The job that ran before the LocalQueue stays outside Kueue; a replacement pod of it is
    # gated by Kueue's pod integration, which the job says.
    assert workload_of(kq, "before") is None
    kcluster.exit("before-worker-0-0", 1)
    kcluster.wait_workers(["before-worker-0-1"], job="before", timeout=90)
    cond = wait_for("the gate reported", lambda: (x := kcluster.condition("Admitted", "before"))
                    .get("reason") == "PodsGatedByKueue" and x)
    assert "externalFrameworks" in cond["message"] and "before-worker-0-1" in cond["message"]

