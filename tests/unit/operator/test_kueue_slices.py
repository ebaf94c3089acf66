"""Growing under Kueue through workload slices, pure (policy.kueue_slices): which of the job's
Workloads is its own, the slice a job admitted below its size asks with, the handover while
Kueue admits it, and what is let go."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from elastrain_operator.model import conditions as c
from elastrain_operator.policy.kueue import KueueView
from elastrain_operator.policy.kueue_slices import HANDOVER_S, chain
from elastrain_operator.policy.planning import plan
from elastrain_operator.render.workload import REPLACEMENT_FOR, SLICE_INDEX
from tests.unit.operator.test_kueue import ADMITTED, FLAVORS, cond, queued_world, workload
from tests.unit.operator.test_planning import T0, World

Manifest = dict[str, Any]
REPLACED = cond("Finished", True, "WorkloadSliceReplaced", "replaced")  # at 2026-01-01T00:00


def splan(w: World, *workloads: Manifest, now: Any = T0, slices: bool = True) -> Any:
    found = chain(list(workloads), now)
    view = KueueView(queue="team", workload=found.main, flavors=FLAVORS, slices=slices,
                     chain=found)
    p = plan(w.parsed(), replace(w.observe(), kueue=view), now=now)
    w.apply(p)
    return p


def as_made(made: Manifest, *conds: Manifest, workers: int | None = None) -> Manifest:
    """The slice the operator created, as the apiserver and Kueue have it then."""
    wl = workload(*conds, workers=workers)
    wl["metadata"] = {**made["metadata"], "resourceVersion": "9", "generation": 1}
    wl["spec"] = made["spec"]
    return wl


def test_the_chain_names_the_job_workload_the_slice_asking_and_the_ones_replaced() -> None:
    first = workload(*ADMITTED, workers=2)
    assert chain([first], T0).main is first
    second = workload(cond("QuotaReserved", False, "Pending", "no quota"))
    second["metadata"].update(name="wl-2", annotations={
        SLICE_INDEX: "2", REPLACEMENT_FOR: f"ml/{first['metadata']['name']}"})
    found = chain([second, first], T0)
    assert (found.main, found.pending, found.handover) == (first, second, None)
    # Kueue finished the first for it and has not written its admission yet: a handover,
    # for HANDOVER_S at most.
    done = {**first, "status": {**first["status"], "conditions": [*ADMITTED, REPLACED]}}
    found = chain([done, second], T0 + timedelta(seconds=1))
    assert (found.main, found.pending, found.handover, found.retired) == (second, None, done, ())
    assert chain([done, second], T0 + timedelta(seconds=HANDOVER_S + 1)).handover is None
    admitted = {**second, "status": {"conditions": list(ADMITTED)}}
    found = chain([done, admitted], T0 + timedelta(seconds=1))
    assert (found.main, found.handover, found.retired) == (admitted, None, (done,))
    # Admitted once, then evicted and queued again: it stands alone (no handover).
    evicted = {**second, "status": {"conditions": [
        cond("QuotaReserved", False), cond("Admitted", False), cond("Evicted", True)]}}
    assert chain([done, evicted], T0 + timedelta(seconds=1)).handover is None


def test_admitted_below_its_size_the_job_grows_by_a_slice_that_replaces_its_workload() -> None:
    w = queued_world(replicas=3, minReplicas=1)
    first = workload(*ADMITTED, workers=2)
    first["spec"].update(priority=100, priorityClassRef={"kind": "WorkloadPriorityClass",
                                                          "name": "low"})
    splan(w, first)
    w.run_all()
    p = splan(w, first)
    made = p.workload.slices.create
    assert made is not None and p.workload.extra.create is None
    name = first["metadata"]["name"]
    assert made["metadata"]["name"] == f"{name}-2"
    assert made["metadata"]["annotations"][REPLACEMENT_FOR] == f"ml/{name}"
    assert made["metadata"]["finalizers"] == ["kueue.x-k8s.io/resource-in-use"]
    assert made["spec"]["queueName"] == "team" and made["spec"]["priority"] == 100
    workers = made["spec"]["podSets"][0]
    assert (workers["name"], workers["count"], workers.get("minCount")) == ("workers", 3, None)
    assert any(e.reason == c.GROWING_BY_SLICE for e in p.events)
    # Waiting: asked once, nothing else changes.
    pending = as_made(made, cond("QuotaReserved", False, "Pending", "no quota"))
    p = splan(w, first, pending)
    assert p.workload.slices.create is None and not p.workload.slices.delete
    assert not p.delete_pods and pending["metadata"]["name"] in w.status["queue"]["message"]
    # Kueue finished the first for it, the slice's admission not written yet: the workers stay
    # and nothing is written to either.
    done = {**first, "status": {**first["status"], "conditions": [*ADMITTED, REPLACED]}}
    p = splan(w, done, pending, now=T0 + timedelta(seconds=1))
    assert not p.delete_pods and w.workers() == ["demo-worker-0-0", "demo-worker-1-0"]
    assert p.workload.status is None and p.workload.spec is None and not p.workload.unfinalize
    assert (p.workload.slices.release, p.workload.slices.delete) == ((), ())
    assert w.status["queue"]["workload"] == name
    # Admitted for 3: worker 2 joins, the slice is the job's Workload, the first one goes.
    admitted = as_made(made, *ADMITTED, workers=3)
    p = splan(w, done, admitted, now=T0 + timedelta(seconds=2))
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]
    assert not p.delete_pods
    assert w.status["queue"]["workload"] == made["metadata"]["name"]
    assert w.status["queue"]["admittedWorkers"] == 3
    assert p.workload.slices.release == (done,) and p.workload.slices.create is None
    released = {**done, "metadata": {**done["metadata"], "finalizers": []}}
    assert splan(w, released, admitted).workload.slices.delete == (released,)


def test_a_slice_no_longer_needed_is_let_go_and_the_switch_off_grows_by_an_extra() -> None:
    w = queued_world(replicas=3, minReplicas=1)
    first = workload(*ADMITTED, workers=2)
    splan(w, first)
    w.run_all()
    made = splan(w, first).workload.slices.create
    pending = as_made(made, cond("QuotaReserved", False, "Pending", "no quota"))
    w.job["spec"]["suspend"] = True
    p = splan(w, first, pending)
    assert p.workload.slices.release == (pending,) and p.workload.slices.delete == (pending,)
    w.job["spec"]["suspend"] = False
    # The job's size changed (replicas 3 -> 2, so what it runs covers it): let go too.
    w.job["spec"]["replicas"] = 2
    p = splan(w, first, pending)
    assert pending in p.workload.slices.delete and p.workload.slices.create is None
    # Without the switch: an extra Workload, no slice.
    w = queued_world(replicas=3, minReplicas=1)
    splan(w, first, slices=False)
    w.run_all()
    p = splan(w, first, slices=False)
    assert p.workload.slices.create is None and p.workload.extra.create is not None
