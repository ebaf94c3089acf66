"""Warm spares (spec.spares) through plan(): desired + spares worker pods, each one counted and
replaced like any other; status keeps members/desired; a spare's report is never training."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from elastrain_operator.describe import describe_job
from elastrain_operator.model import conditions as c
from elastrain_operator.policy.progress import ProgressReport, parse_progress
from tests.unit.operator.test_planning import T0, World, started

INPROCESS = {"recovery": {"mode": "InProcess"}}


def with_spares(spares: int = 1, **spec: Any) -> World:
    return started(**INPROCESS, spares=spares, **spec)


def report(step: int, role: str | None, *, started_at: datetime = T0,
           last_step: datetime | None = None,
           training_since: datetime | None = None) -> ProgressReport:
    doc: dict[str, Any] = {"step": step, "totalSteps": 100, "worldSize": 2,
                           "startedAt": started_at.isoformat()}
    if last_step is not None:
        doc["lastStepTime"] = last_step.isoformat()
    if training_since is not None:
        doc["trainingSince"] = training_since.isoformat()
    if role is not None:
        doc["role"] = role
    parsed = parse_progress(doc)
    assert parsed is not None
    return parsed


def test_the_job_keeps_desired_plus_spares_worker_pods() -> None:
    w = with_spares()
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]
    assert [s["index"] for s in w.status["slots"]] == [0, 1, 2]
    # Desired stays the workers: the scale subresource and the WORKERS column read it.
    assert (w.status["replicas"], w.status["workers"], w.status["readyReplicas"]) == (2, "2/2", 2)
    assert w.status["readySpares"] == 0  # nobody polled yet
    assert w.condition(c.ALL_WORKERS_RUNNING)["message"] == "all 2 workers + 1 spare running"
    assert w.condition(c.RUNNING)["message"] == (
        "3 of 2 workers + 1 spare running (minReplicas 1)")
    assert w.reconcile(T0).create == ()  # idempotent


def test_without_spares_no_ready_spares_field_and_the_same_pods() -> None:
    w = started(**INPROCESS)
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0"]
    assert "readySpares" not in w.status
    assert w.condition(c.ALL_WORKERS_RUNNING)["message"] == "all 2 workers running"


def test_ready_spares_come_from_the_poll_and_stay_between_polls() -> None:
    w = with_spares()
    polled = (report(7, "member"), report(7, "member"), report(0, "spare"))
    w.reconcile(T0, progress=polled)
    assert (w.status["readySpares"], w.status["readyReplicas"], w.status["workers"]) == (
        1, 2, "2/2")
    assert "Spares: 1 ready of 1" in describe_job(w.job, list(w.pods.values()))
    w.reconcile(T0 + timedelta(seconds=1))  # a watch event's round: no poll
    assert w.status["readySpares"] == 1
    # A member's pod is lost before the next poll: the spare takes its place.
    w.set_pod("demo-worker-0-0", "Running", ready=False)
    w.reconcile(T0 + timedelta(seconds=2))
    assert (w.status["readySpares"], w.status["workers"]) == (0, "2/2")
    # Its replacement is Ready: no spare until a poll says so.
    w.set_pod("demo-worker-0-0", "Running")
    w.reconcile(T0 + timedelta(seconds=3))
    assert (w.status["readySpares"], w.status["workers"]) == (0, "2/2")
    w.reconcile(T0 + timedelta(seconds=4), progress=polled)
    assert (w.status["readySpares"], w.status["workers"]) == (1, "2/2")


def test_spares_the_trainers_keep_out_of_the_world_are_not_ready_workers() -> None:
    # The trainers' batch rule can keep a world smaller than desired: 2 of 4 ready pods wait.
    w = with_spares(replicas=3)
    polled = (report(7, "member"), report(7, "member"), report(0, "spare"), report(0, "spare"))
    w.reconcile(T0, progress=polled)
    assert (w.status["readyReplicas"], w.status["readySpares"], w.status["workers"]) == (
        2, 2, "2/3")
    w.reconcile(T0 + timedelta(seconds=1))  # no poll: the same
    assert (w.status["readyReplicas"], w.status["readySpares"]) == (2, 2)


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_losing_any_slots_pod_is_counted_once_and_replaced(lost: int) -> None:
    w = with_spares()
    w.set_pod(f"demo-worker-{lost}-0", "Failed", exit_code=143,
              disruption="PreemptionByScheduler")
    p = w.reconcile(T0 + timedelta(seconds=5))
    assert (p.counted_preemptions, w.status["preemptions"], w.status["restarts"]) == (1, 1, 0)
    assert [m["metadata"]["name"] for m in p.create] == [f"demo-worker-{lost}-1"]
    assert len(w.workers()) == 3
    for second in (6, 7):
        w.reconcile(T0 + timedelta(seconds=second))
    w.run_all()
    w.reconcile(T0 + timedelta(seconds=8))
    assert (w.status["preemptions"], w.status["restarts"]) == (1, 0)
    assert len(w.workers()) == 3 and w.status["replicas"] == 2


def test_the_job_is_back_once_desired_workers_run_while_the_new_spare_starts() -> None:
    w = with_spares()
    w.set_pod("demo-worker-0-0", "Failed", exit_code=143, disruption="PreemptionByScheduler")
    w.reconcile(T0 + timedelta(seconds=1))
    assert w.condition(c.RESTARTING)["status"] == "True"
    # demo-worker-0-1 is still Pending; the running spare took its place.
    p = w.reconcile(T0 + timedelta(seconds=2))
    assert [e.message for e in p.events if e.reason == c.RECOVERED] == [
        "back to 2 workers 1.0s after a loss"]
    assert p.recovered_after_seconds == 1.0
    assert w.condition(c.RESTARTING)["status"] == "False"
    all_running = w.condition(c.ALL_WORKERS_RUNNING)
    assert (all_running["status"], all_running["message"]) == (
        "False", "2 of 2 workers + 1 spare running, 1 pending")


def test_scaling_keeps_the_spares_and_counts_nothing() -> None:
    w = with_spares()
    w.job["spec"]["replicas"] = 3
    p = w.reconcile(T0)
    assert [m["metadata"]["name"] for m in p.create] == ["demo-worker-3-0"]
    w.run_all()
    w.job["spec"]["replicas"] = 1
    p = w.reconcile(T0)
    assert sorted(p.delete_pods) == ["demo-worker-2-0", "demo-worker-3-0"]
    assert (w.status["restarts"], w.status["preemptions"], w.status["replicas"]) == (0, 0, 1)
    w.job["spec"]["spares"] = 0
    assert w.reconcile(T0).delete_pods == ("demo-worker-1-0",)
    assert "readySpares" not in w.status


def test_a_spares_report_is_never_the_jobs_step() -> None:
    w = with_spares()
    # A spare knows the step it last saw; even a larger one is not the job's.
    w.reconcile(T0, progress=(report(7, "member"), report(9, "spare")))
    assert w.status["progress"]["step"] == 7
    w.reconcile(T0, progress=(report(12, "spare"),))  # only the spare answered
    assert w.status["progress"]["step"] == 7


def test_a_waiting_spare_never_makes_the_job_look_hung() -> None:
    w = with_spares(hangTimeoutSeconds=600)
    # Only the spare answered, and it has not stepped since it started long ago.
    p = w.reconcile(T0 + timedelta(seconds=3600), progress=(report(0, "spare"),))
    assert not p.hung and w.status.get("restarts", 0) == 0
    assert not [x for x in w.status["conditions"] if x["type"] == c.HUNG]


def test_a_fresh_spare_does_not_hide_hung_members() -> None:
    w = with_spares(hangTimeoutSeconds=600)
    last = T0 + timedelta(seconds=30)
    now = last + timedelta(seconds=600)
    p = w.reconcile(now, progress=(report(12, "member", last_step=last),
                                   report(0, "spare", started_at=now)))
    assert p.hung and p.counted_restarts == 1
    # Every running worker pod restarts, the spare's too: one counted failure.
    assert sorted(p.delete_pods) == ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]


def test_a_spares_training_since_is_no_recovery() -> None:
    w = with_spares()
    w.set_pod("demo-worker-0-0", "Failed", exit_code=143, disruption="PreemptionByScheduler",
              at=T0)
    w.reconcile(T0 + timedelta(seconds=1))
    after = T0 + timedelta(seconds=2)
    w.reconcile(after, progress=(report(7, "spare", training_since=after),))
    assert "lastRecovery" not in w.status
    p = w.reconcile(after, progress=(report(7, "member", training_since=after),))
    assert p.training_recovery is not None and w.status["lastRecovery"]["seconds"] == 2.0


def test_a_spare_that_saw_the_job_done_finishes_it_like_any_worker() -> None:
    w = with_spares()
    w.set_pod("demo-worker-2-0", "Succeeded", exit_code=0)  # the spare exits first
    w.reconcile(T0)
    assert w.condition(c.RUNNING)["reason"] == c.JOB_FINISHING
    assert (w.status["restarts"], w.status["preemptions"]) == (0, 0)
    for name in ("demo-worker-0-0", "demo-worker-1-0"):
        w.set_pod(name, "Succeeded", exit_code=0)
    w.reconcile(T0 + timedelta(seconds=1))
    assert w.status["phase"] == "Succeeded"
