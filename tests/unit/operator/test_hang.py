"""The progress watchdog (policy.hang) through plan(): hung -> one counted failure, all workers
restarted, Hung condition and events; slow but progressing jobs and silent rounds are left be."""

from __future__ import annotations

from datetime import datetime, timedelta

from elastrain_operator.model import conditions as c
from elastrain_operator.policy.progress import ProgressReport, parse_progress
from tests.unit.operator.test_planning import T0, World, started


def report(step: int, *, started_at: datetime, last_step: datetime | None) -> ProgressReport:
    doc = {"step": step, "totalSteps": 100, "startedAt": started_at.isoformat(),
           "lastStepTime": last_step.isoformat() if last_step else None}
    parsed = parse_progress(doc)
    assert parsed is not None
    return parsed


def hung_world() -> World:
    return started(hangTimeoutSeconds=600, restartPolicy={"maxRestarts": 3, "backoffSeconds": 0})


def test_no_step_for_the_timeout_restarts_every_worker_as_one_counted_failure() -> None:
    w = hung_world()
    last = T0 + timedelta(seconds=30)
    reports = (report(12, started_at=T0, last_step=last),
               report(12, started_at=T0, last_step=last - timedelta(seconds=1)))
    # 599 s without a step: not yet.
    p = w.reconcile(last + timedelta(seconds=599), progress=reports)
    assert not p.delete_pods and w.status.get("restarts", 0) == 0 and not p.hung
    p = w.reconcile(last + timedelta(seconds=600), progress=reports)
    assert p.hung and p.counted_restarts == 1
    assert sorted(p.delete_pods) == ["demo-worker-0-0", "demo-worker-1-0"]
    assert (w.status["restarts"], w.status.get("preemptions", 0)) == (1, 0)
    hung = w.condition(c.HUNG)
    assert (hung["status"], hung["reason"]) == ("True", c.NO_TRAINING_PROGRESS)
    assert "no training step completed for 600s (spec.hangTimeoutSeconds=600)" in hung["message"]
    assert [e.reason for e in p.events if e.type == "Warning"].count(c.NO_TRAINING_PROGRESS) == 1
    assert w.status["recentLosses"][-1]["reason"].startswith("hung: no training step")
    # The deleted pods are the old attempts: the next rounds count nothing more.
    w.reconcile(last + timedelta(seconds=601))
    w.reconcile(last + timedelta(seconds=602))
    assert (w.status["restarts"], w.status.get("preemptions", 0)) == (1, 0)
    assert sorted(n for n in w.pods if "worker" in n) == ["demo-worker-0-1", "demo-worker-1-1"]


def test_hung_clears_once_a_step_ends_after_it() -> None:
    w = hung_world()
    last = T0 + timedelta(seconds=30)
    hung_at = last + timedelta(seconds=700)
    w.reconcile(hung_at, progress=(report(12, started_at=T0, last_step=last),))
    w.run_all()
    restarted = hung_at + timedelta(seconds=20)
    w.reconcile(restarted, progress=(report(10, started_at=restarted, last_step=None),))
    assert w.condition(c.HUNG)["status"] == "True"
    p = w.reconcile(restarted + timedelta(seconds=5), progress=(
        report(11, started_at=restarted, last_step=restarted + timedelta(seconds=4)),))
    assert (w.condition(c.HUNG)["status"], w.condition(c.HUNG)["reason"]) == (
        "False", c.TRAINING_PROGRESSING)
    assert any(e.reason == c.TRAINING_PROGRESSING for e in p.events)
    assert w.status["restarts"] == 1


def test_slow_steps_silence_and_a_disabled_watchdog_never_fire() -> None:
    last = T0 + timedelta(seconds=30)
    late = last + timedelta(hours=2)
    # Steps keep ending, each slower than... nothing: the newest one is recent.
    w = hung_world()
    p = w.reconcile(late, progress=(report(40, started_at=T0, last_step=late - timedelta(
        seconds=599)),))
    assert not p.hung and not p.delete_pods
    # A restarted group still loading: its start is recent even though no step ended yet.
    p = w.reconcile(late, progress=(report(40, started_at=late - timedelta(seconds=60),
                                           last_step=None),))
    assert not p.hung
    # Nobody answered (or polling is off): no verdict.
    assert not w.reconcile(late, progress=()).hung
    assert not w.reconcile(late).hung
    # 0 turns the watchdog off.
    off = started(hangTimeoutSeconds=0)
    assert not off.reconcile(late, progress=(report(1, started_at=T0, last_step=last),)).hung
    assert c.HUNG not in [x["type"] for x in off.status["conditions"]]


def test_the_watchdog_spends_the_restart_budget() -> None:
    w = World.new(hangTimeoutSeconds=60, restartPolicy={"maxRestarts": 0})
    w.reconcile(T0)
    w.run_all()
    w.reconcile(T0)
    w.reconcile(T0 + timedelta(seconds=61), progress=(report(3, started_at=T0, last_step=T0),))
    assert w.status["phase"] == "Failed"
    failed = w.condition(c.FAILED)
    assert failed["reason"] == c.MAX_RESTARTS_EXCEEDED
    assert "hung: no training step completed for 61s" in failed["message"]
