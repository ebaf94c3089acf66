"""Scenarios 22 and 23: real Kueue (v0.17.0) on the real node, with real trainers (issue 36
items 3 and 4); 23 is described in its test.

The operator tier (tests/integration/kueue) shows the Workload's life against real Kueue with a
fake kubelet; what only real trainers can show is the promise itself: preempted, the job loses
no step. An InProcess job (3 workers, min 2) labelled with a LocalQueue at a low priority is
admitted and trains; its newest periodic checkpoint is behind the step in flight, so a plain
suspend would lose the steps since. A Workload of a higher priority that does not fit beside it
is created in the same ClusterQueue (`withinClusterQueue: LowerPriority`): Kueue evicts the
job's Workload; the operator stops the pods gracefully, the trainers save at their next step
boundary, the quota is released and Kueue admits the preemptor. The job waits Queued; once the
preemptor is gone it is admitted again and resumes from the step it had reached: 0 steps lost,
nothing counted as a preemption or a restart. Kueue's pod integration is on in the namespace
(its webhook sees the job's pods): they are neither gated nor given Workloads of their own.

Kueue runs for this module only (tests/e2e/kueue_job.py); the module runs last in the session
(conftest), so no other test meets an operator that follows Kueue.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import NodeCluster
from tests.e2e.kueue_job import QueuedJob, Queues, kueue_running, queued_job
from tests.e2e.support import (
    ARTIFACTS,
    INPROCESS,
    LogCollector,
    Training,
    event_reasons,
    group_starts,
    record_recovery,
    steps_retrained,
    wait_for,
)
from tests.integration.kueue.fixtures import admitted, condition

JOB = "queued"
YIELDING = "yielding"
INTERVAL_STEPS = 40


@pytest.fixture(scope="module")
def kueue_on_node(operator: NodeCluster,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    with kueue_running(operator, tmp_path_factory.mktemp("kueue")):
        yield operator


def test_22_preempted_by_kueue_the_job_saves_releases_its_quota_and_resumes_losing_nothing(
        kueue_on_node: NodeCluster, job_namespace: str) -> None:
    node, ns, k = kueue_on_node, job_namespace, kueue_on_node.kubectl
    queues = Queues(ns)
    try:
        queues.create(node)
        k.apply(queued_job(node, queues, JOB, steps=100_000, interval_steps=INTERVAL_STEPS,
                           recovery={"mode": INPROCESS}))
        with LogCollector(k, ns, Training.worker_selector(JOB), ARTIFACTS / JOB) as logs:
            _preempted_and_resumed(QueuedJob(k, ns, JOB, logs, INPROCESS), queues)
    finally:
        k("delete", "trainingjob", JOB, "-n", ns, "--wait=false", check=False)
        queues.delete(node)


def _preempted_and_resumed(t: QueuedJob, queues: Queues) -> None:
    t.settle()
    wl = t.workload()
    assert wl is not None and admitted(wl), wl
    assert wl["spec"]["priority"] == 100
    # Kueue's pod webhook saw the pods (the namespace is Kueue's): none is gated, and none has a
    # Workload of its own.
    for pod in t.all_pods():
        assert not pod["spec"].get("schedulingGates"), pod["metadata"]["name"]
    assert t.workload_names() == [wl["metadata"]["name"]]
    # A periodic commit behind the step in flight: what a plain suspend would fall back to.
    wait_for("a periodic commit", t.committed, timeout=180)
    t.logs.wait_for_step(t.committed() + 5)
    before = t.counters()

    p = t.preempt(queues)
    assert t.all_pods() == [], [pod["metadata"]["name"] for pod in t.all_pods()]
    wl = t.workload()
    assert wl is not None and wl["status"].get("admission") is None, wl
    assert (condition(wl, "Evicted") or {}).get("reason") == "Preempted", wl
    assert (condition(wl, "Requeued") or {}).get("status") == "True", wl
    assert "EvictedByKueue" in event_reasons(t.k, t.ns, JOB)
    # Saved at the step boundary: every step trained is in the newest commit, which a plain
    # suspend would not have made.
    assert p.saved == p.reached > p.periodic, p
    wait_for("the job Queued", lambda: t.status().get("phase") == "Queued", timeout=60)

    _, resumed = t.readmit()
    assert int(resumed["step"]) == p.reached, (resumed, p)
    t.settle()
    assert t.counters() == before
    record_recovery("kueue preemption: eviction -> quota free", p.freed_s,
                    steps_lost=p.reached - int(resumed["step"]),
                    plain_suspend_would_lose=p.reached - p.periodic,
                    interval_steps=INTERVAL_STEPS)


def test_23_a_more_urgent_workload_takes_a_workers_quota_and_the_job_trains_on_in_process(
        kueue_on_node: NodeCluster, job_namespace: str) -> None:
    """Shrink to yield (issue 36 item 4) under Kueue's default policy (no preemption within
    the ClusterQueue): the waiting Workload would wait for as long as the job runs. The job,
    above its minimum, lets one worker go at a step boundary; the two others train on in their
    processes; once the pod is gone Kueue hears it (reclaimablePods) and admits the Workload.
    Nothing is evicted, stopped or counted."""
    node, ns, k = kueue_on_node, job_namespace, kueue_on_node.kubectl
    # The job's 3 x 100m and its store's 50m fit, with 50m left: the Workload's 100m lacks 50m.
    queues = Queues(ns, cpu="400m", preempts=False)
    try:
        queues.create(node)
        k.apply(queued_job(node, queues, YIELDING, steps=100_000, recovery={"mode": INPROCESS}))
        with LogCollector(k, ns, Training.worker_selector(YIELDING), ARTIFACTS / YIELDING) as logs:
            _yielded(QueuedJob(k, ns, YIELDING, logs, INPROCESS), queues)
    finally:
        k("delete", "trainingjob", YIELDING, "-n", ns, "--wait=false", check=False)
        queues.delete(node)


def _yielded(t: QueuedJob, queues: Queues) -> None:
    t.settle()
    before, processes = t.counters(), t.processes()
    at, admitted_s = t.urgent(queues, "100m")
    wl = t.workload()
    assert wl is not None and admitted(wl) and condition(wl, "Evicted") is None, wl
    assert wl["status"].get("reclaimablePods") == [{"name": "workers", "count": 1}], wl
    assert "YieldedQuota" in event_reasons(t.k, t.ns, YIELDING)
    step = wait_for("a step at world 2", lambda: next(
        (r for r in t.logs.events("step") if float(r["time"]) > at and r["world_size"] == 2),
        None), timeout=60)
    # Never stopped: no group started again, nothing retrained, the two left kept their
    # processes, nothing counted.
    assert group_starts(t.logs, at) == []
    assert steps_retrained(t.logs, at) == 0
    after = t.processes()
    assert len(after) == 2 and all(processes[pod] == inc for pod, inc in after.items()), after
    assert t.counters() == before
    status = t.status()
    assert (status["queue"]["admittedWorkers"], status["queue"]["yieldedWorkers"]) == (2, 1)
    leave = next((r for r in t.logs.events("regroup") if float(r["time"]) > at), {})
    record_recovery("kueue shrink to yield: urgent Workload admitted", admitted_s,
                    first_step_at_world_2_s=round(float(step["time"]) - at, 2),
                    survivors_pause_s=round(float(leave.get("regroup_s", 0))
                                            + float(leave.get("heal_s", 0)), 3))
