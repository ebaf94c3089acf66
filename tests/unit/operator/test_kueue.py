"""Kueue, pure: the Workload a job asks with, where its admission stands, what the planner does
with it (no pod before admission, the admitted size and flavors, stop then release on eviction)
and what it writes back to the Workload."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from elastrain_operator.describe import describe_job
from elastrain_operator.model import conditions as c
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import QueueStatus
from elastrain_operator.policy.failures import WorkerPod
from elastrain_operator.policy.kueue import (
    KueueView,
    derive_gate,
    gated_pods,
    queue_of,
    workload_write,
)
from elastrain_operator.policy.planning import plan
from elastrain_operator.render.workload import (
    DEACTIVATED_BY as DEACTIVATED,
)
from elastrain_operator.render.workload import (
    POD_SETS_HASH,
    Placement,
    Priority,
    flavor_placement,
    place,
    render_workload,
    workload_name,
)
from tests.unit.operator.test_planning import T0, World, terminating

Manifest = dict[str, Any]
QUEUE = "kueue.x-k8s.io/queue-name"


def job(**spec: Any) -> TrainingJob:
    w = World.new(**spec)
    w.job["metadata"]["labels"] = {QUEUE: "team"}
    return w.parsed()


def cond(kind: str, status: bool, reason: str = "R", message: str = "") -> Manifest:
    return {"type": kind, "status": "True" if status else "False", "reason": reason,
            "message": message, "lastTransitionTime": "2026-01-01T00:00:00+00:00"}


def workload(*conds: Manifest, workers: int | None = None, flavor: str = "spot",
             **extra: Any) -> Manifest:
    status: Manifest = {"conditions": list(conds)}
    if workers is not None:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "workers", "count": workers, "flavors": {"cpu": flavor}},
            {"name": "store", "count": 1, "flavors": {"cpu": flavor}}]}
    status.update(extra)
    return {"metadata": {"name": workload_name(job()), "namespace": "ml", "resourceVersion": "7",
                         "generation": 1, "finalizers": ["kueue.x-k8s.io/resource-in-use"]},
            "spec": {"queueName": "team"}, "status": status}


ADMITTED = (cond("QuotaReserved", True), cond("Admitted", True))
FLAVORS = {"spot": {"metadata": {"name": "spot"}, "spec": {
    "nodeLabels": {"pool": "spot"},
    "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}}}


# ------------------------------------------------------------------------------ the Workload


def test_the_workload_asks_for_the_workers_the_spares_and_the_store() -> None:
    j = job(replicas=3, minReplicas=2, recovery={"mode": "InProcess"}, spares=1,
            resources={"requests": {"cpu": "1"}})
    wl = render_workload(j, "team", Priority("WorkloadPriorityClass", "low", 10))
    sets = {s["name"]: s for s in wl["spec"]["podSets"]}
    assert (sets["workers"]["count"], sets["workers"]["minCount"]) == (3, 2)
    assert (sets["spares"]["count"], sets["store"]["count"]) == (1, 1)
    worker = sets["workers"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["requests"]["cpu"] == "1"
    assert sets["store"]["template"]["spec"]["containers"][0]["name"] == "rdzv-store"
    assert wl["spec"]["queueName"] == "team"
    assert wl["spec"]["priority"] == 10
    assert wl["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io",
                                              "kind": "WorkloadPriorityClass", "name": "low"}
    meta = wl["metadata"]
    assert meta["finalizers"] == ["kueue.x-k8s.io/resource-in-use"]
    assert meta["ownerReferences"][0]["controller"] is True
    assert meta["name"] == workload_name(j) and meta["name"].startswith("trainingjob-demo-")


def test_a_fixed_size_job_has_no_min_count_and_no_spares_set() -> None:
    wl = render_workload(job(replicas=2, minReplicas=2), "team", None)
    assert [(s["name"], "minCount" in s) for s in wl["spec"]["podSets"]] == [
        ("workers", False), ("store", False)]
    assert "priority" not in wl["spec"]


def test_the_name_differs_for_a_job_made_again_under_the_same_name() -> None:
    a = job()
    b = a.model_copy(update={"metadata": a.metadata.model_copy(update={"uid": "u2"})})
    assert workload_name(a) != workload_name(b)


def test_placement_merges_flavor_labels_and_tolerations_and_refuses_a_conflict() -> None:
    pod = {"metadata": {"name": "p", "labels": {"a": "1"}},
           "spec": {"nodeSelector": {"zone": "x"}, "tolerations": [{"key": "t"}]}}
    placed = place(pod, flavor_placement(FLAVORS["spot"]).merged(
        Placement(labels={"b": "2"}, annotations={"n": "v"})))
    assert placed["spec"]["nodeSelector"] == {"zone": "x", "pool": "spot"}
    spot = FLAVORS["spot"]["spec"]["tolerations"][0]
    assert placed["spec"]["tolerations"] == [{"key": "t"}, spot]
    assert placed["metadata"]["labels"] == {"a": "1", "b": "2"}
    assert placed["metadata"]["annotations"] == {"n": "v"}
    assert pod["spec"]["nodeSelector"] == {"zone": "x"}  # not changed in place
    with pytest.raises(ValueError, match="zone=y conflicts"):
        place(pod, Placement(node_selector={"zone": "y"}))


# ------------------------------------------------------------------------------- the queue


def test_the_queue_is_the_label_else_the_default_local_queue_for_a_new_job_only() -> None:
    labelled, bare = job(), World.new().parsed()
    assert queue_of(labelled, False) == "team"
    assert queue_of(bare, False) is None
    assert queue_of(bare, True) == "default"
    seen = bare.model_copy(update={"status": bare.status.model_copy(
        update={"observed_generation": 1})})
    assert queue_of(seen, True) is None  # ran before the LocalQueue came: stays outside
    kept = seen.model_copy(update={"status": seen.status.model_copy(
        update={"queue": QueueStatus(name="default")})})
    assert queue_of(kept, False) == "default"  # decided once, kept


@pytest.mark.parametrize(("wl", "state", "runs", "words"), [
    (None, "Creating", False, "creating Workload"),
    (workload(cond("QuotaReserved", False, "Pending", "insufficient quota for cpu")),
     "Queued", False, "insufficient quota for cpu"),
    (workload(*ADMITTED, workers=2), "Admitted", True, "admitted by ClusterQueue cq for 2"),
    (workload(*ADMITTED, cond("Evicted", True, "Preempted", "to admit b"),
              cond("Preempted", True, "InClusterQueue"), workers=2),
     "Evicted", False, "Preempted, InClusterQueue: to admit b"),
    (workload(cond("QuotaReserved", False), cond("Evicted", True, "Preempted", "to admit b")),
     "Queued", False, "requeued in LocalQueue team after an eviction"),
    (workload(cond("Finished", True, "Succeeded")), "Finished", False, "is finished"),
])
def test_the_gate_follows_the_workload(wl: Manifest | None, state: str, runs: bool,
                                       words: str) -> None:
    gate = derive_gate(job(), KueueView(queue="team", workload=wl, flavors=FLAVORS))
    assert (gate.state, gate.runs) == (state, runs)
    assert words in gate.message


def test_a_deactivated_workload_is_not_queued_and_a_missing_api_says_so() -> None:
    wl = workload(cond("QuotaReserved", False))
    wl["spec"]["active"] = False
    assert "deactivated" in derive_gate(job(), KueueView(queue="team", workload=wl)).message
    gate = derive_gate(job(), KueueView(queue="team", served=False))
    assert (gate.runs, gate.reason) == (False, c.KUEUE_NOT_SERVED)


def test_the_admission_places_each_pod_set_with_its_flavors_and_updates() -> None:
    wl = workload(*ADMITTED, workers=2, admissionChecks=[{"name": "prov", "state": "Ready",
                  "podSetUpdates": [{"name": "workers", "labels": {"check": "yes"}}]}])
    gate = derive_gate(job(), KueueView(queue="team", workload=wl, flavors=FLAVORS))
    assert gate.placement["workers"].node_selector == {"pool": "spot"}
    assert gate.placement["workers"].labels == {"check": "yes"}
    assert gate.placement["store"].labels == {}
    unknown = derive_gate(job(), KueueView(queue="team", workload=workload(
        *ADMITTED, workers=2, flavor="gone"), flavors=FLAVORS))
    assert unknown.runs and "not found" in unknown.message


def test_gated_pods_are_those_with_kueues_admission_gate() -> None:
    pods = [WorkerPod(name="a", index=0, attempt=0,
                      scheduling_gates=("kueue.x-k8s.io/admission",)),
            WorkerPod(name="b", index=1, attempt=0, scheduling_gates=("other",))]
    assert gated_pods(pods) == ["a"]


# ----------------------------------------------------------------------------- the planner


def queued_world(**spec: Any) -> World:
    w = World.new(**spec)
    w.job["metadata"]["labels"] = {QUEUE: "team"}
    return w


def kplan(w: World, wl: Manifest | None, *, now: Any = T0) -> Any:
    observed = replace(w.observe(), kueue=KueueView(queue="team", workload=wl, flavors=FLAVORS))
    p = plan(w.parsed(), observed, now=now)
    w.apply(p)
    return p


def test_no_pod_before_admission_and_the_workload_is_created_once() -> None:
    w = queued_world()
    p = kplan(w, None)
    assert p.create_workload is not None and w.pods == {}
    assert [m["kind"] for m in p.create] == ["Service", "Service"]
    assert w.status["phase"] == "Queued"
    assert w.status["queue"]["state"] == "Creating"
    assert w.condition(c.ADMITTED)["reason"] == c.QUEUED
    p = kplan(w, workload(cond("QuotaReserved", False, "Pending", "no quota")))
    assert p.create_workload is None and w.pods == {}
    assert w.status["queue"]["message"].endswith("no quota")
    assert "Kueue: Queued in LocalQueue team (Workload trainingjob-demo-" in describe_job(
        w.job, [])


def test_admitted_the_job_runs_the_admitted_workers_on_the_flavor() -> None:
    w = queued_world(replicas=4, minReplicas=2)
    kplan(w, None)
    kplan(w, workload(*ADMITTED, workers=3))
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]
    for pod in w.pods.values():
        assert pod["spec"]["nodeSelector"]["pool"] == "spot", pod["metadata"]["name"]
    assert (w.status["replicas"], w.status["queue"]["admittedWorkers"]) == (3, 3)
    for name in w.workers():  # the first generation waits for no more nodes than admitted
        env = {e["name"]: e.get("value") for e in w.pods[name]["spec"]["containers"][0]["env"]}
        assert env["ELASTRAIN_REPLICAS"] == "3", name
    assert w.condition(c.ADMITTED)["status"] == "True"
    assert any(e.reason == c.ADMITTED_BY_KUEUE for e in kplan(w, workload(*ADMITTED, workers=3))
               .events) is False  # announced once, on the transition


def test_evicted_the_pods_stop_uncounted_and_the_quota_goes_once_none_is_left() -> None:
    w = queued_world()
    kplan(w, None)
    kplan(w, workload(*ADMITTED, workers=2))
    w.run_all()
    kplan(w, workload(*ADMITTED, workers=2))
    evicted = workload(*ADMITTED, cond("Evicted", True, "Preempted", "for b"), workers=2)
    running = {n: copy.deepcopy(w.pods[n]) for n in w.workers()}
    p = kplan(w, evicted)
    # The workers stop first, through their store (their stop's save), which goes after them.
    assert sorted(p.delete_pods) == ["demo-worker-0-0", "demo-worker-1-0"]
    assert p.workload.status is None  # pods still there: the quota stays reserved
    assert w.status["phase"] == "Queued" and w.status["queue"]["state"] == "Evicted"
    assert any(e.reason == c.EVICTED_BY_KUEUE for e in p.events)
    terminating(w, running)  # their kubelet has not stopped them yet: the store stays
    p = kplan(w, evicted, now=T0 + timedelta(seconds=2))
    assert "demo-rdzv" not in p.delete_pods
    for name in w.workers(live=False):
        w.release(name)
        w.pods.pop(name, None)
    p = kplan(w, evicted, now=T0 + timedelta(seconds=4))
    assert p.delete_pods == ("demo-rdzv",)  # the workers gone: now their store
    assert p.workload.status is None  # still a pod of the job: the quota stays reserved
    w.pods.pop("demo-rdzv", None)
    p = kplan(w, evicted, now=T0 + timedelta(seconds=5))
    patch = p.workload.status
    assert patch is not None and patch["status"]["admission"] is None
    assert patch["metadata"]["resourceVersion"] == "7"
    conds = {x["type"]: x for x in patch["status"]["conditions"]}
    assert (conds["QuotaReserved"]["status"], conds["QuotaReserved"]["reason"]) == (
        "False", "Pending")
    assert (conds["Requeued"]["status"], conds["Requeued"]["reason"]) == ("True", "Preempted")
    assert conds["Admitted"]["status"] == "False"
    assert any(e.reason == c.QUOTA_RELEASED for e in p.events)
    assert (w.status["preemptions"], w.status["restarts"]) == (0, 0)


def test_a_deactivated_eviction_is_released_without_a_requeue() -> None:
    wl = workload(*ADMITTED, cond("Evicted", True, "Deactivated", "spec.active false"),
                  workers=2)
    write = workload_write(job(), KueueView(queue="team", workload=wl),
                           derive_gate(job(), KueueView(queue="team", workload=wl)),
                           pods_left=False, ready_workers=0, phase="Queued", now=T0)
    assert write.status is not None
    conds = {x["type"]: x for x in write.status["status"]["conditions"]}
    assert conds["Requeued"]["status"] == "False"


def current(j: TrainingJob, wl: Manifest) -> Manifest:
    """`wl` with the pod sets `j` renders, as the operator made it."""
    made = render_workload(j, "team", None)
    wl["spec"]["podSets"] = made["spec"]["podSets"]
    wl["metadata"].setdefault("annotations", {})[POD_SETS_HASH] = \
        made["metadata"]["annotations"][POD_SETS_HASH]
    return wl


def spec_write(j: TrainingJob, wl: Manifest) -> Any:
    view = KueueView(queue="team", workload=wl)
    return workload_write(j, view, derive_gate(j, view), pods_left=False, ready_workers=0,
                          phase="Suspended" if j.spec.suspend else "Queued", now=T0).spec


def test_a_suspended_job_deactivates_its_workload_and_its_resume_activates_only_ours() -> None:
    suspended, resumed = job(suspend=True), job()
    off = spec_write(suspended, current(resumed, workload(*ADMITTED, workers=2)))
    assert off == {"metadata": {"resourceVersion": "7",
                                "annotations": {DEACTIVATED: "spec.suspend"}},
                   "spec": {"active": False}}
    queued = current(resumed, workload(cond("QuotaReserved", False)))
    assert spec_write(suspended, queued)["spec"]["active"] is False  # nor admitted later
    ours = current(resumed, workload(cond("QuotaReserved", False)))
    ours["spec"]["active"] = False
    ours["metadata"]["annotations"][DEACTIVATED] = "spec.suspend"
    assert spec_write(suspended, ours) is None  # done already
    assert spec_write(resumed, ours) == {"metadata": {
        "resourceVersion": "7", "annotations": {DEACTIVATED: None}}, "spec": {"active": True}}
    theirs = current(resumed, workload(cond("QuotaReserved", False)))
    theirs["spec"]["active"] = False  # an administrator's deactivation stays
    assert spec_write(resumed, theirs) is None
    assert spec_write(resumed, current(resumed, workload(*ADMITTED, workers=2))) is None
    made = render_workload(suspended, "team", None)
    assert made["spec"]["active"] is False
    assert made["metadata"]["annotations"][DEACTIVATED] == "spec.suspend"
    assert "active" not in render_workload(resumed, "team", None)["spec"]


def test_a_spec_change_reaches_the_pod_sets_of_a_workload_holding_no_quota_only() -> None:
    before, after = job(replicas=2), job(replicas=3, resources={"requests": {"cpu": "2"}})
    waiting = current(before, workload(cond("QuotaReserved", False)))
    patch = spec_write(after, waiting)
    assert patch is not None and patch["metadata"]["resourceVersion"] == "7"
    sets = {s["name"]: s for s in patch["spec"]["podSets"]}
    assert sets["workers"]["count"] == 3
    worker = sets["workers"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["requests"]["cpu"] == "2"
    assert patch["metadata"]["annotations"][POD_SETS_HASH] == \
        render_workload(after, "team", None)["metadata"]["annotations"][POD_SETS_HASH]
    assert spec_write(before, waiting) is None  # unchanged
    assert spec_write(after, current(before, workload(*ADMITTED, workers=2))) is None


def test_pods_ready_finished_and_the_finalizer() -> None:
    wl = workload(*ADMITTED, workers=2)
    view = KueueView(queue="team", workload=wl)
    gate = derive_gate(job(), view)

    def write(**kw: Any) -> Any:
        return workload_write(job(), view, gate, **{"pods_left": True, "ready_workers": 2,
                                                    "phase": "Running", "now": T0, **kw})

    ready = write().status
    assert ready is not None and ready["status"]["conditions"][-1]["type"] == "PodsReady"
    assert ready["status"]["conditions"][-1]["status"] == "True"
    assert write(ready_workers=1).status["status"]["conditions"][-1]["status"] == "False"
    done = write(phase="Succeeded").status
    assert done is not None and done["status"]["conditions"][-1]["type"] == "Finished"
    assert not write().unfinalize
    finished = workload(cond("Finished", True))
    assert workload_write(job(), KueueView(queue="team", workload=finished),
                          derive_gate(job(), KueueView(queue="team", workload=finished)),
                          pods_left=False, ready_workers=0, phase="Succeeded",
                          now=T0).unfinalize


def test_a_job_queued_in_the_default_local_queue_is_labelled_with_it() -> None:
    bare = World.new().parsed()
    view = KueueView(queue="default")
    gate = derive_gate(bare, view)
    assert workload_write(bare, view, gate, pods_left=False, ready_workers=0, phase="Queued",
                          now=T0).label_queue == "default"
    assert workload_write(job(), KueueView(queue="team"), gate, pods_left=False,
                          ready_workers=0, phase="Queued", now=T0).label_queue is None


# --------------------------------------------------------------------- the watches' view


def test_the_watches_keep_each_jobs_workload_the_default_queues_and_flavors() -> None:
    from elastrain_operator.k8s.kueue import KueueState

    state = KueueState()
    j = job()
    owned = workload(*ADMITTED, workers=2)
    owned["metadata"]["name"] = workload_name(j)  # the name the operator gives it
    owned["metadata"]["ownerReferences"] = [{
        "apiVersion": "elastrain.dev/v1alpha1", "kind": "TrainingJob", "name": "demo",
        "uid": "u1", "controller": True}]
    stranger = {"metadata": {"name": "w2", "namespace": "ml", "ownerReferences": [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "demo", "uid": "u1",
         "controller": True}]}}
    assert state.put_workload(stranger) is None
    assert state.put_workload(owned) == ("ml", "demo")
    state.put_flavor(FLAVORS["spot"])
    view = state.view(None, j)
    assert view is not None and view.workload is owned and view.flavors == FLAVORS
    assert state.orphans(("ml", "demo")) == [owned]
    assert state.view(None, World.new().parsed()) is None  # no label, no default queue
    state.put_local_queue({"metadata": {"name": "default", "namespace": "ml"}})
    bare = state.view(None, World.new().parsed())
    assert bare is not None and bare.queue == "default"
    assert state.remove_workload(owned) == ("ml", "demo")
    assert state.view(None, j).workload is None  # type: ignore[union-attr]
    assert KueueState(served=False).view(None, j) == KueueView(queue="team", served=False)


def test_a_suspended_job_deactivates_its_workload_only_once_its_pods_are_gone() -> None:
    """Kueue stops counting a deactivated Workload's quota at once (v0.17.0's
    HasActiveQuotaReservation): the pods, still saving, stay inside it until they are gone."""
    suspended, resumed = job(suspend=True), job()
    wl = current(resumed, workload(*ADMITTED, workers=2))
    view = KueueView(queue="team", workload=wl)
    write = workload_write(suspended, view, derive_gate(suspended, view), pods_left=True,
                           ready_workers=0, phase="Suspended", now=T0)
    assert write.spec is None
    assert spec_write(suspended, wl)["spec"] == {"active": False}
