"""Growing under Kueue, pure (policy.kueue_grow): the extra Workload a job admitted below its
size asks with, the workers its admission adds, and their leave when Kueue takes it back."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from elastrain_operator.model import conditions as c
from elastrain_operator.policy.kueue import KueueView
from elastrain_operator.policy.planning import plan
from tests.unit.operator.test_kueue import ADMITTED, FLAVORS, cond, queued_world, workload
from tests.unit.operator.test_planning import T0, World

Manifest = dict[str, Any]
ON_DEMAND = {"metadata": {"name": "on-demand"}, "spec": {"nodeLabels": {"pool": "on-demand"}}}


def gplan(w: World, wl: Manifest, extra: Manifest | None, *, now: Any = T0) -> Any:
    view = KueueView(queue="team", workload=wl, extra=extra,
                     flavors={**FLAVORS, "on-demand": ON_DEMAND})
    p = plan(w.parsed(), replace(w.observe(), kueue=view), now=now)
    w.apply(p)
    return p


def extra_admitted(made: Manifest, workers: int, *conds: Manifest) -> Manifest:
    extra = {**made, "metadata": {**made["metadata"], "resourceVersion": "3", "generation": 1,
                                  "uid": "x1"}}
    extra["status"] = {"conditions": list(conds or ADMITTED), "admission": {
        "clusterQueue": "cq", "podSetAssignments": [
            {"name": "workers", "count": workers, "flavors": {"cpu": "on-demand"}}]}}
    return extra


def test_admitted_below_its_size_the_job_asks_for_the_rest_and_grows_in_place() -> None:
    w = queued_world(replicas=3, minReplicas=1)
    ours = workload(*ADMITTED, workers=2)
    ours["spec"].update(priority=100, priorityClassRef={"kind": "WorkloadPriorityClass",
                                                         "name": "low"})
    gplan(w, ours, None)
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0"]
    w.run_all()
    p = gplan(w, ours, None)
    made = p.workload.extra.create
    assert made is not None and made["metadata"]["name"].endswith("-more")
    assert made["spec"]["queueName"] == "team" and made["spec"]["priority"] == 100
    assert [(s["name"], s["count"]) for s in made["spec"]["podSets"]] == [("workers", 1)]
    assert "finalizers" not in made["metadata"]
    # Not admitted yet: nothing changes, nothing is asked again.
    p = gplan(w, ours, made)
    assert p.workload.extra.create is None and not p.delete_pods
    # Admitted for one worker: worker 2 joins on the extra's flavor, the others stay.
    extra = extra_admitted(made, 1)
    p = gplan(w, ours, extra)
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]
    assert not p.delete_pods
    assert w.pods["demo-worker-2-0"]["spec"]["nodeSelector"]["pool"] == "on-demand"
    assert w.pods["demo-worker-0-0"]["spec"]["nodeSelector"]["pool"] == "spot"
    assert w.status["queue"]["admittedWorkers"] == 3
    w.run_all()
    p = gplan(w, ours, extra)
    assert p.workload.extra.status["status"]["conditions"][-1]["type"] == "PodsReady"


def test_taken_back_by_kueue_the_extra_workers_leave_then_its_quota_goes() -> None:
    w = queued_world(replicas=3, minReplicas=1)
    ours = workload(*ADMITTED, workers=2)
    gplan(w, ours, None)
    w.run_all()
    made = gplan(w, ours, None).workload.extra.create
    extra = extra_admitted(made, 1)
    gplan(w, ours, extra)
    w.run_all()
    evicted = extra_admitted(made, 1, *ADMITTED, cond("Evicted", True, "Preempted", "for u"),
                             cond("Preempted", True, "InClusterQueue", "by u"))
    p = gplan(w, ours, evicted, now=T0 + timedelta(seconds=1))
    assert p.delete_pods == ("demo-worker-2-0",)  # its worker leaves first
    assert p.workload.extra.status is None  # the quota stays while its pod is there
    w.release("demo-worker-2-0")
    w.pods.pop("demo-worker-2-0", None)
    p = gplan(w, ours, evicted, now=T0 + timedelta(seconds=2))
    patch = p.workload.extra.status["status"]
    assert patch["admission"] is None
    conds = {x["type"]: x["status"] for x in patch["conditions"]}
    assert (conds["QuotaReserved"], conds["Requeued"]) == ("False", "True")
    assert any(e.reason == c.QUOTA_RELEASED and "extra workers" in e.message for e in p.events)
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0"]
    assert (w.status["preemptions"], w.status["restarts"]) == (0, 0)


def test_an_extra_workload_no_longer_needed_is_deleted() -> None:
    w = queued_world(replicas=3, minReplicas=1)
    ours = workload(*ADMITTED, workers=2)
    gplan(w, ours, None)
    w.run_all()
    made = gplan(w, ours, None).workload.extra.create
    pending = {**made, "metadata": {**made["metadata"], "resourceVersion": "3", "uid": "x1"}}
    # Scaled to 2: the job's own admission covers every worker.
    w.job["spec"]["replicas"] = 2
    assert gplan(w, ours, pending).workload.extra.delete
    # Or asking for another count than is wanted now while it holds nothing: asked anew.
    w.job["spec"]["replicas"] = 4
    assert gplan(w, ours, pending).workload.extra.delete


def test_a_job_with_spares_asks_for_no_extra_workload() -> None:
    w = queued_world(replicas=3, minReplicas=1, spares=1, recovery={"mode": "InProcess"})
    ours = workload(*ADMITTED, workers=2)
    gplan(w, ours, None)
    w.run_all()
    assert gplan(w, ours, None).workload.extra.create is None
