"""Operator restarts at any moment change nothing: every lost pod is counted exactly once.

A restart is simulated by applying only a prefix of a plan's side effects (status write first,
then pod deletions, finalizer releases, creations) and planning again from the world as left.
"""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from tests.unit.operator.test_planning import T0, World, started


def converge(w: World, seconds: int = 0) -> None:
    for _ in range(4):
        w.reconcile(T0 + timedelta(seconds=seconds))


@pytest.mark.parametrize("loss", ["preempt", "fail", "delete"])
def test_crash_after_every_step_counts_once(loss: str) -> None:
    steps = len(World.steps(started(), started().plan(T0)))
    for crash_after in range(0, steps + 8):
        w = started(restartPolicy={"backoffSeconds": 0})
        if loss == "preempt":
            w.set_pod("demo-worker-1-0", "Failed", exit_code=143,
                      disruption="PreemptionByScheduler")
        elif loss == "fail":
            w.set_pod("demo-worker-1-0", "Failed", exit_code=1)
        else:
            w.delete("demo-worker-1-0")
        w.apply(w.plan(T0), crash_after=crash_after)
        converge(w)
        counted = (w.status["preemptions"], w.status["restarts"])
        assert counted == ((0, 1) if loss == "fail" else (1, 0)), crash_after
        assert w.workers() == ["demo-worker-0-0", "demo-worker-1-1"], crash_after
        assert w.workers(live=False) == w.workers(), "a stale pod was left behind"


def test_random_flows_with_random_restarts_keep_counters_exact() -> None:
    rng = random.Random(4)
    for _ in range(30):
        w = started(replicas=3, minReplicas=1, maxReplicas=5,
                    restartPolicy={"backoffSeconds": 0, "maxRestarts": 1000})
        expected = {"preemptions": 0, "restarts": 0}
        for _ in range(12):
            live = [n for n in w.workers()
                    if w.pods[n]["status"]["phase"] in ("Running", "Pending")]
            event = rng.choice(["preempt", "fail", "delete", "scale", "nothing"])
            if event == "scale":
                w.job["spec"]["replicas"] = rng.randint(1, 5)
            elif live and event != "nothing":
                victim = rng.choice(live)
                if event == "preempt":
                    w.set_pod(victim, "Failed", disruption="TerminationByKubelet")
                    expected["preemptions"] += 1
                elif event == "fail":
                    w.set_pod(victim, "Failed", exit_code=1)
                    expected["restarts"] += 1
                else:
                    w.delete(victim)
                    expected["preemptions"] += 1
            p = w.plan(T0)
            w.apply(p, crash_after=rng.randint(0, len(w.steps(p))))
            converge(w)
            w.run_all()
            converge(w)
            assert {k: w.status[k] for k in expected} == expected
            desired = w.job["spec"]["replicas"]
            indexes = sorted(int(w.pods[n]["metadata"]["labels"]["elastrain.dev/worker-index"])
                             for n in w.workers())
            assert indexes == list(range(desired)), "missing or duplicate worker"
            assert w.workers(live=False) == w.workers()
