"""Shrink to yield, pure (policy.kueue_yield, policy.kueue, k8s.kueue_quota): which workers a
job gives back to a more urgent Workload that Kueue would not preempt for, and what it writes
to its own Workload once they are gone."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from typing import Any

from elastrain_operator.k8s.kueue import KueueState
from elastrain_operator.k8s.kueue_quota import pod_requests, queue_terms, shortfall, waiting_of
from elastrain_operator.model import conditions as c
from elastrain_operator.policy.kueue import KueueView
from elastrain_operator.policy.kueue_yield import (
    YIELD_INTERVAL_S,
    Waiting,
    decide_yield,
    lends,
)
from elastrain_operator.policy.planning import plan
from elastrain_operator.render.workload import workload_name
from tests.unit.operator.test_kueue import ADMITTED, FLAVORS, cond, queued_world, workload
from tests.unit.operator.test_planning import T0, World

Manifest = dict[str, Any]
# Kueue v0.17.0's own words for a Workload that does not fit (seen against the real manager).
KUEUE_SAYS = ("couldn't assign flavors to pod set main: insufficient unused quota for cpu in "
              "flavor spot, 300m more needed")
EACH = {"cpu": Decimal("0.5"), "memory": Decimal(256 * 2**20)}


def urgent(short: dict[str, tuple[str, Decimal]] | None = None, priority: int = 1000,
           name: str = "urgent") -> Waiting:
    return Waiting("ml", name, priority, short if short is not None
                   else {"cpu": ("spot", Decimal("0.3"))})


def decide(*waiting: Waiting, running: int = 3, minimum: int = 1, policy: str | None = None,
           last: Any = None, flavors: dict[str, str] | None = None) -> Any:
    return decide_yield(priority=100, running=running, minimum=minimum, per_worker=EACH,
                        flavors=flavors or {"cpu": "spot", "memory": "spot"},
                        waiting=list(waiting), within_cluster_queue=policy, last=last, now=T0)


def test_kueues_message_says_what_a_waiting_workload_lacks() -> None:
    assert shortfall(KUEUE_SAYS) == {"cpu": ("spot", Decimal("0.3"))}
    two = (KUEUE_SAYS + "; insufficient unused quota for memory in flavor spot, 1Gi more needed")
    assert shortfall(two) == {"cpu": ("spot", Decimal("0.3")),
                              "memory": ("spot", Decimal(2**30))}
    wl = {"metadata": {"name": "u", "namespace": "ml"}, "spec": {"priority": 7},
          "status": {"conditions": [cond("QuotaReserved", False, "Pending", KUEUE_SAYS)]}}
    assert waiting_of(wl) == Waiting("ml", "u", 7, {"cpu": ("spot", Decimal("0.3"))})
    assert waiting_of({**wl, "status": {"conditions": [cond("QuotaReserved", True)]}}) is None
    assert waiting_of({**wl, "spec": {"active": False}}) is None


def test_one_pod_asks_its_containers_sum_or_a_larger_init_container_plus_overhead() -> None:
    pod = {"spec": {"containers": [{"resources": {"requests": {"cpu": "500m"},
                                                  "limits": {"memory": "1Gi"}}},
                                   {"resources": {"requests": {"cpu": "100m"}}}],
                    "initContainers": [{"resources": {"requests": {"cpu": "2"}}}],
                    "overhead": {"cpu": "10m"}}}
    assert pod_requests(pod) == {"cpu": Decimal("2.01"), "memory": Decimal(2**30)}


def test_the_fewest_workers_that_cover_the_shortfall_never_below_the_minimum() -> None:
    y = decide(urgent())
    assert y is not None and y.workers == 1 and y.to.name == "urgent"
    assert "gave back 1 worker(s)' quota to Workload ml/urgent" in y.message
    big = urgent({"cpu": ("spot", Decimal("0.8")), "memory": ("spot", Decimal(2**20))})
    assert decide(big).workers == 2  # type: ignore[union-attr]
    assert decide(big, minimum=2) is None  # would go below minReplicas
    assert decide(urgent(), running=1) is None


def test_no_yield_where_kueue_preempts_to_a_lower_priority_too_soon_or_elsewhere() -> None:
    assert decide(urgent(), policy="LowerPriority") is None  # Kueue evicts the job whole
    assert decide(urgent(), policy="Never") is not None
    assert decide(urgent(priority=100)) is None  # not more urgent than the job
    assert decide(urgent(), flavors={"cpu": "on-demand"}) is None  # its quota would not help
    assert decide(urgent({"nvidia.com/gpu": ("spot", Decimal(1))})) is None  # none held
    assert decide(urgent(), last=T0 - timedelta(seconds=YIELD_INTERVAL_S - 1)) is None
    assert decide(urgent(), last=T0 - timedelta(seconds=YIELD_INTERVAL_S)) is not None
    # The most urgent first.
    y = decide(urgent(priority=500, name="a"), urgent(priority=900, name="b"))
    assert y is not None and y.to.name == "b"


def cq(cohort: str | None = "team", reclaim: str | None = None,
       **limits: str) -> Manifest:
    """A ClusterQueue with `limits` (lendingLimit, borrowingLimit) on cpu of flavor spot."""
    resource = {"name": "cpu", "nominalQuota": "2", **limits}
    spec: Manifest = {"resourceGroups": [{"coveredResources": ["cpu"], "flavors": [
        {"name": "spot", "resources": [resource]}]}]}
    if cohort:
        spec["cohortName"] = cohort
    if reclaim:
        spec["preemption"] = {"reclaimWithinCohort": reclaim}
    return {"metadata": {"name": "q"}, "spec": spec}


def test_in_the_cohort_only_where_kueue_would_not_reclaim_and_the_quota_can_reach_it() -> None:
    w = urgent()  # lacks 300m of spot cpu
    assert lends(queue_terms(cq()), queue_terms(cq()), w)
    assert not lends(queue_terms(cq()), queue_terms(cq("other")), w)  # another cohort
    assert not lends(queue_terms(cq(None)), queue_terms(cq(None)), w)  # no cohort
    for policy in ("Any", "LowerPriority"):  # Kueue reclaims for it itself
        assert not lends(queue_terms(cq()), queue_terms(cq(reclaim=policy)), w)
    assert lends(queue_terms(cq()), queue_terms(cq(reclaim="Never")), w)
    assert not lends(queue_terms(cq(lendingLimit="200m")), queue_terms(cq()), w)
    assert not lends(queue_terms(cq()), queue_terms(cq(borrowingLimit="100m")), w)
    assert lends(queue_terms(cq(lendingLimit="300m")), queue_terms(cq(borrowingLimit="1")), w)
    # A cohort's Workload is yielded to even where Kueue preempts within the job's own queue.
    sibling = replace(w, cohort=True)
    y = decide(sibling, policy="LowerPriority")
    assert y is not None and "to Workload in the cohort ml/urgent" in y.message
    assert decide(w, policy="LowerPriority") is None


def yplan(w: World, wl: Manifest, *, waiting: tuple[Waiting, ...] = (urgent(),),
          now: Any = T0) -> Any:
    view = KueueView(queue="team", workload=wl, flavors=FLAVORS, yielding=True,
                     waiting=waiting, per_worker=EACH)
    p = plan(w.parsed(), replace(w.observe(), kueue=view), now=now)
    w.apply(p)
    return p


def test_the_job_lets_a_worker_go_then_tells_kueue_its_quota_is_free() -> None:
    w = queued_world(replicas=3, minReplicas=1)
    ours = workload(*ADMITTED, workers=3, flavor="spot")
    ours["spec"]["priority"] = 100
    yplan(w, ours, waiting=())
    w.run_all()
    yplan(w, ours, waiting=())
    assert w.status["phase"] == "Running"
    p = yplan(w, ours)
    assert [e.message for e in p.events if e.reason == c.YIELDED_QUOTA] == [
        "gave back 1 worker(s)' quota to Workload ml/urgent (priority 1000 > 100), which lacked "
        "0.3 cpu; training goes on with 2 workers (minReplicas 1)"]
    q = w.status["queue"]
    assert (q["yieldedWorkers"], q["admittedWorkers"]) == (1, 3)
    # The next round runs 2: worker 2 leaves; Kueue hears of it only once its pod is gone.
    p = yplan(w, ours, now=T0 + timedelta(seconds=1))
    assert p.delete_pods == ("demo-worker-2-0",)
    assert w.status["queue"]["admittedWorkers"] == 2
    assert p.workload.status is None or "reclaimablePods" not in p.workload.status["status"]
    w.release("demo-worker-2-0")
    w.pods.pop("demo-worker-2-0", None)
    p = yplan(w, ours, now=T0 + timedelta(seconds=2))
    assert p.workload.status["status"]["reclaimablePods"] == [{"name": "workers", "count": 1}]
    assert not any(e.reason == c.YIELDED_QUOTA for e in p.events)  # once per interval
    # Kueue took note: nothing more to write; still admitted, nothing counted.
    ours["status"]["reclaimablePods"] = [{"name": "workers", "count": 1}]
    p = yplan(w, ours, waiting=(), now=T0 + timedelta(seconds=3))
    assert "reclaimablePods" not in (p.workload.status or {"status": {}})["status"]
    assert (w.status["preemptions"], w.status["restarts"]) == (0, 0)
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0"]
    # Evicted later: the quota goes back whole, the next admission counts every worker again.
    evicted = workload(*ADMITTED, cond("Evicted", True, "Preempted", "x"), workers=3)
    yplan(w, evicted, waiting=(), now=T0 + timedelta(seconds=4))
    for name in list(w.pods):
        w.release(name)
        w.pods.pop(name, None)
    p = yplan(w, evicted, waiting=(), now=T0 + timedelta(seconds=5))
    assert p.workload.status["status"]["reclaimablePods"] is None
    assert w.status["queue"]["yieldedWorkers"] == 0


def test_the_watches_find_the_jobs_a_waiting_workload_could_take_workers_from() -> None:
    state = KueueState(yielding=True)
    j = queued_world(replicas=3, minReplicas=1, resources={"requests": {"cpu": "500m"}}).parsed()
    ours = workload(*ADMITTED, workers=3)
    ours["metadata"]["name"] = workload_name(j)
    ours["metadata"]["ownerReferences"] = [{"controller": True, "kind": "TrainingJob",
                                            "apiVersion": "elastrain.dev/v1alpha1",
                                            "name": j.metadata.name, "uid": j.metadata.uid}]
    ours["metadata"]["namespace"] = j.metadata.namespace
    state.put_workload(ours)
    state.put_local_queue({"metadata": {"name": "team", "namespace": "ml"},
                           "spec": {"clusterQueue": "cq"}})
    state.put_cluster_queue({"metadata": {"name": "cq"},
                             "spec": {"preemption": {"withinClusterQueue": "Never"}}})
    other = {"metadata": {"name": "u", "namespace": "ml"},
             "spec": {"queueName": "team", "priority": 1000},
             "status": {"conditions": [cond("QuotaReserved", False, "Pending", KUEUE_SAYS)]}}
    state.put_workload(other)
    assert state.jobs_waited_on(other) == [(j.metadata.namespace, j.metadata.name)]
    view = state.view(None, j)
    assert view is not None and view.yielding and view.within_cluster_queue == "Never"
    assert [w.name for w in view.waiting] == ["u"]
    assert view.per_worker["cpu"] == Decimal("0.5")
    state.remove_workload(other)
    view = state.view(None, j)
    assert view is not None and view.waiting == ()
    # A sibling ClusterQueue of its cohort, Kueue's default reclaim policy: its Workload too.
    state.put_cluster_queue({"metadata": {"name": "cq"}, "spec": {
        "cohortName": "org", "preemption": {"withinClusterQueue": "Never"}}})
    state.put_cluster_queue({"metadata": {"name": "cq2"}, "spec": {"cohortName": "org"}})
    state.put_local_queue({"metadata": {"name": "other", "namespace": "ml"},
                           "spec": {"clusterQueue": "cq2"}})
    sibling = {**other, "metadata": {"name": "s", "namespace": "ml"},
               "spec": {"queueName": "other", "priority": 1000}}
    state.put_workload(sibling)
    assert state.jobs_waited_on(sibling) == [(j.metadata.namespace, j.metadata.name)]
    view = state.view(None, j)
    assert view is not None and [(w.name, w.cohort) for w in view.waiting] == [("s", True)]
    state.put_cluster_queue({"metadata": {"name": "cq2"}, "spec": {
        "cohortName": "org", "preemption": {"reclaimWithinCohort": "Any"}}})
    assert state.view(None, j).waiting == ()  # type: ignore[union-attr]
    off = KueueState(yielding=False)
    off.put_workload(ours)
    off.put_workload(other)
    assert off.jobs_waited_on(other) == []
    view = off.view(None, j)
    assert view is not None and not view.yielding


def test_no_growth_is_asked_for_while_a_more_urgent_workload_of_the_cohort_waits() -> None:
    w = queued_world(replicas=3, minReplicas=1)
    ours = workload(*ADMITTED, workers=2)
    yplan(w, ours)
    w.run_all()
    sibling = replace(urgent(), cohort=True)
    # (It gives a worker back to it too: 2 running, min 1.)
    held = yplan(w, ours, waiting=(sibling,))
    assert held.workload.extra.create is None
    elsewhere = yplan(w, ours, waiting=(
        replace(sibling, short={"cpu": ("on-demand", Decimal("0.3"))}),))
    assert elsewhere.workload.extra.create is not None  # it waits for another flavor
    # In the job's own ClusterQueue Kueue puts it first anyway: the request keeps its place.
    assert yplan(w, ours, waiting=(urgent(),)).workload.extra.create is not None
    assert yplan(w, ours, waiting=()).workload.extra.create is not None
