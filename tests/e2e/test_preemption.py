"""Scenarios 1-3, 5-8, 14 and 15 of the e2e suite, on one long-running TrainingJob (3 workers,
min 2, DDP over gloo, checkpoints to MinIO on the pod bridge), in order, once per recovery mode
(spec.recovery.mode: `restart`, then `inprocess`, each its own job). Each scenario reads the
counter deltas it causes from the job's status and events, and training continuity from the
trainers' own records (step, resumed-from step, generation changes), and records its recovery
time (worker lost -> first training step after the resume or the regroup) in
runs/e2e/recovery.json.

What differs per mode is stated per mode (docs/recovery.md section 12): in InProcess mode the
survivors keep their pods and their trainer processes (read from the node's /proc: the torchrun
agent's worker PIDs and start times, and the container's restartCount), a loss with notice
loses no step and one without notice at most the step in flight, and status.lastRecovery
records the in-process path. Restart mode's assertions are those the suite had before.

One job per mode because starting three torch workers costs a minute on two cores; each
scenario first waits until the job is back at full size and training.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import OPERATOR_NAMESPACE, NamespacePool, NodeCluster
from tests.e2e.support import (
    ARTIFACTS,
    INPROCESS,
    RECOVERY_MODES,
    RESTART,
    Incarnation,
    LogCollector,
    Training,
    container_pid,
    event_reasons,
    make_job,
    record_recovery,
    recovery_spec,
    scrape,
    steps_lost_at,
    steps_retrained,
    wait_for,
)

INTERVAL_STEPS = 20
NODE = "elastrain-node"
# Scenario 3 fails one worker and 14 two: room for them and one more than that, so a run
# that meets an unexpected failure tells it by its assertion, not by the job failing.
MAX_RESTARTS = 6
# Far below the collective timeout (5 minutes in both modes, docs/recovery.md section 8) and
# above the heartbeat's bound: a recovery this long means the survivors waited on something
# other than a closed socket or the heartbeat.
NO_NOTICE_BOUND_S = 30


class ChaosJob(Training):
    """The module's job, and the operator's own counters of it."""

    @property
    def workers_selector(self) -> str:
        return Training.worker_selector(self.job)

    def operator_metrics(self) -> tuple[float, float, float]:
        """(preemptions_total, restarts_total, training recoveries observed) from the operator
        pod's /metrics; this job is the only one losing workers while the module runs. A
        sample's labels (the recovery histogram's mode) are summed over."""
        pods = self.k.json("get", "pods", "-n", OPERATOR_NAMESPACE, "-l",
                           "app.kubernetes.io/name=elastrain")["items"]
        (ip,) = [p["status"]["podIP"] for p in pods if p["status"].get("phase") == "Running"
                 and not p["metadata"].get("deletionTimestamp")]
        m = scrape(f"http://{ip}:9090/metrics")

        def total(name: str) -> float:
            return sum(v for key, v in m.items() if key.split("{", 1)[0] == name)

        return (total("elastrain_operator_preemptions_total"),
                total("elastrain_operator_restarts_total"),
                total("elastrain_operator_training_recovery_seconds_count"))

    def settle(self, replicas: int = 3) -> None:
        """Also a committed checkpoint: a loss without notice in Restart mode resumes from one,
        so each scenario holds whichever ran before it (scenario 14 run alone killed before
        the first commit, and the job rightly started fresh, with no resume to measure)."""
        super().settle(replicas)
        wait_for("a committed checkpoint", lambda: self.status().get("lastCheckpoint"),
                 timeout=180)

    def steps_lost(self, at: float) -> int:
        """Restart mode: the suite's measure (last step before `at` - the step the resume
        loaded); InProcess: steps trained again after `at` (there may be no resume at all)."""
        return steps_lost_at(self.logs, at) if self.mode == RESTART else \
            steps_retrained(self.logs, at)

    def record(self, scenario: str, seconds: float, **details: Any) -> None:
        record_recovery(scenario, seconds, mode=self.mode, **details)

    def check_survivors(self, before: dict[str, Incarnation], lost: set[str]) -> None:
        """The pods not lost are still there; in InProcess mode they also kept their trainer
        processes (same container, no container restart, the same worker PIDs and start
        times). Restart mode restarts the survivors' workers by design: printed, not asserted."""
        after = self.processes()
        survivors = {name: inc for name, inc in before.items() if name not in lost}
        kept = sorted(n for n, inc in survivors.items() if after.get(n) == inc)
        print(f"[{self.mode}] survivors {sorted(survivors)}: trainer processes kept by {kept}; "
              f"before {survivors}, after { {n: after.get(n) for n in survivors} }")
        if self.mode == INPROCESS:
            assert set(survivors) <= set(after), "a survivor's pod is gone"
            assert all(inc.workers for inc in survivors.values()), \
                f"no trainer process seen in a survivor: {survivors}"
            assert kept == sorted(survivors), "a survivor's trainer process was restarted"


@pytest.fixture(scope="module", params=list(RECOVERY_MODES.values()),
                ids=list(RECOVERY_MODES))
def training(request: pytest.FixtureRequest, operator: NodeCluster,
             namespace_pool: NamespacePool) -> Iterator[ChaosJob]:
    """One job per recovery mode (`chaos-restart`, `chaos-inprocess`), one after the other."""
    mode: str = request.param
    job = f"chaos-{mode.lower()}"
    k = operator.kubectl
    ns = namespace_pool.take()  # held by this mode's one job throughout
    k.apply(make_job(job, ns, image=operator.images["trainer"], steps=100_000,
                     s3_endpoint=operator.s3.endpoint_url, bucket=operator.s3.bucket,
                     interval_steps=INTERVAL_STEPS,
                     restartPolicy={"maxRestarts": MAX_RESTARTS, "backoffSeconds": 1},
                     **recovery_spec(mode)))
    with LogCollector(k, ns, Training.worker_selector(job), ARTIFACTS / job) as logs:
        t = ChaosJob(k, ns, job, logs, mode)
        t.settle()
        yield t
    namespace_pool.give_back(ns)


def _preempt_and_check(t: ChaosJob, index: int, scenario: str) -> None:
    t.settle()
    before = t.counters()
    metrics_before = t.operator_metrics()
    pod = t.worker(index)
    processes = t.processes()
    at = t.evict(pod)
    first = t.recovered_after(at)
    t.record(scenario, float(first["time"]) - at, pod=pod, resumed_from=first["step"] - 1,
             world_size=first["world_size"])
    if t.mode == INPROCESS:  # the survivors trained on without the leaver
        assert first["world_size"] == 2
    t.check_survivors(processes, lost={pod})  # asserted in InProcess mode, printed in Restart
    # The pod the operator saw: preempted (DisruptionTarget), never a failure.
    wait_for("the preemption counted", lambda: t.counters()[0] == before[0] + 1)
    t.settle()
    assert t.counters() == (before[0] + 1, before[1])
    assert t.steps_lost(at) == 0, "the SIGTERM checkpoint lost steps"
    assert "WorkerPreempted" in event_reasons(t.k, t.ns, t.job)
    wait_for("the recovery in the operator's metrics",
             lambda: t.operator_metrics()[2] == metrics_before[2] + 1)
    assert t.operator_metrics()[:2] == (metrics_before[0] + 1, metrics_before[1])
    assert t.status()["lastRecovery"]["pod"] == pod
    if t.mode == INPROCESS:  # scenario 12: the replacement joined, healed from a live peer
        assert t.status()["lastRecovery"]["mode"] == INPROCESS
        print(f"[{t.mode}] lastRecovery: {t.status()['lastRecovery']}")
        t.check_survivors(processes, lost={pod})
        joins = [r for r in t.logs.events("regroup")
                 if float(r["time"]) > at and r.get("healed_from") and r["world_size"] == 3]
        assert joins, "the replacement did not join healed from a peer"
        print(f"[{t.mode}] replacement joined: {joins[0]}")
        # The join time without a spare (scenario 16 has it with one): world 3 again.
        whole = wait_for("a step at world 3 after the join", lambda: next(
            (r for r in t.logs.events("step") if float(r["time"]) > float(joins[0]["time"])
             and r.get("world_size") == 3), None))
        t.record(f"{scenario}-full-world", float(whole["time"]) - at, pod=pod,
                 full_world_s=round(float(whole["time"]) - at, 2))


def test_1_evicted_worker_resumes_from_its_sigterm_checkpoint(training: ChaosJob) -> None:
    _preempt_and_check(training, 1, "1-evict-worker-1")


def test_2_evicting_worker_0_loses_no_rendezvous(training: ChaosJob) -> None:
    _preempt_and_check(training, 0, "2-evict-worker-0")


def _sigkill(t: ChaosJob, pod: str) -> float:
    """SIGKILLs the pod's trainer container (its first process: the whole container dies, no
    notice); returns when."""
    pid = container_pid(t.k, t.ns, pod)
    at = time.time()
    os.kill(pid, signal.SIGKILL)
    return at


def test_3_sigkilled_worker_recovers_within_the_checkpoint_interval(training: ChaosJob) -> None:
    t = training
    t.settle()
    before = t.counters()
    metrics_before = t.operator_metrics()
    pod = t.worker(2)
    processes = t.processes()
    at = _sigkill(t, pod)
    first = t.recovered_after(at)
    recovery = float(first["time"]) - at
    t.record("3-sigkill-worker-2", recovery, pod=pod, resumed_from=first["step"] - 1,
             world_size=first["world_size"])
    if t.mode == INPROCESS:
        assert recovery < NO_NOTICE_BOUND_S, "the survivors waited on more than a closed socket"
    t.check_survivors(processes, lost={pod})
    # An exit the trainer did not choose (137, no DisruptionTarget) is a failure by policy.
    wait_for("the failure counted", lambda: t.counters()[1] == before[1] + 1)
    t.settle()
    assert t.counters() == (before[0], before[1] + 1)
    if t.mode == RESTART:
        assert steps_lost_at(t.logs, at) <= INTERVAL_STEPS
    else:  # without notice: at most the step in flight
        assert steps_retrained(t.logs, at) <= 1
    assert "WorkerFailed" in event_reasons(t.k, t.ns, t.job)
    assert t.operator_metrics()[:2] == (metrics_before[0], metrics_before[1] + 1)
    if t.mode == INPROCESS:
        wait_for("the in-process recovery recorded",
                 lambda: (t.status().get("lastRecovery") or {}).get("pod") == pod)
        t.check_survivors(processes, lost={pod})


def _store(t: ChaosJob) -> dict[str, Any] | None:
    done = t.k("get", "pod", f"{t.job}-rdzv", "-n", t.ns, "-o", "json", check=False)
    return json.loads(done.stdout) if done.returncode == 0 else None


def _ready(pod: dict[str, Any] | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_5_lost_rendezvous_store_is_recreated_without_a_failure(training: ChaosJob) -> None:
    """Restart mode: every torchrun agent exits when the store goes (c10d rendezvous state
    lives only there); the operator recreates the store, counts each such worker as preempted
    (never a failure), replaces it, and training resumes from the checkpoint the agents'
    SIGTERM made. InProcess mode (section 12, scenario 17): no agent uses the job's store, the
    trainers train on through the loss, nothing is counted and nobody restarts."""
    t = training
    t.settle()
    before = t.counters()
    old = _store(t)
    assert old is not None
    processes = t.processes()
    at = time.time()
    t.k("delete", "pod", f"{t.job}-rdzv", "-n", t.ns, "--wait=false")
    wait_for("a new store pod, Ready", lambda: (new := _store(t)) is not None and _ready(new)
             and new["metadata"]["uid"] != old["metadata"]["uid"], timeout=120)
    if t.mode == INPROCESS:
        ready = time.time()
        wait_for("a training step with the new store", lambda: [
            r for r in t.logs.events("step") if float(r["time"]) > ready], timeout=120)
        # Training goes on without the store; the scenario ends once every member is back on
        # the new one: a test that changes the world next (scenario 6's scale-down) found a
        # member still reconnecting, judged it silent, and restarted (seen once).
        wait_for("every member back on the new store", lambda: set(processes) <= {
            r["node"] for r in t.logs.events("store_back") if float(r["time"]) > at},
            timeout=120)
        t.settle()
        # No recovery to time: the longest pause between two steps across the loss instead.
        times = [float(r["time"]) for r in t.logs.events("step")]
        times = times[max((i for i, x in enumerate(times) if x <= at), default=0):]
        t.record("5-store-pod-deleted", max(b - a for a, b in itertools.pairwise(times)),
                 longest_step_gap=True, store_ready_s=round(ready - at, 2))
        assert t.counters() == before, "losing the store was counted"
        assert steps_retrained(t.logs, at) == 0
        t.check_survivors(processes, lost=set())
        return
    first = t.resumed_after(at)
    t.record("5-store-pod-deleted", float(first["time"]) - at)
    t.settle()
    preemptions, restarts = t.counters()
    assert restarts == before[1], "losing the store was counted as a failure"
    lost = [x for x in t.status().get("recentLosses", [])
            if x["time"] >= time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(at)))]
    assert lost and all("rendezvous store lost" in x["reason"] for x in lost), lost
    assert preemptions == before[0] + len(lost)
    assert steps_lost_at(t.logs, at) == 0


def test_6_scale_down_and_up_keeps_training(training: ChaosJob) -> None:
    t = training
    t.settle()
    before = t.counters()
    processes = t.processes()
    at = time.time()
    t.k("scale", "trainingjob", t.job, "-n", t.ns, "--replicas=2")
    t.settle(replicas=2)
    t.k("scale", "trainingjob", t.job, "-n", t.ns, "--replicas=3")
    t.settle(replicas=3)
    assert t.counters() == before, "a scale event was counted as a loss"
    if t.mode == RESTART:
        worlds = [int(r["world_size"]) for r in t.logs.events("resumed")]
        assert worlds[-2:] == [2, 3]
    else:  # two generation changes, no restart: the pods kept through both kept their trainers
        worlds = [int(r["world_size"]) for r in t.logs.events("regroup")
                  if float(r["time"]) > at]
        assert worlds[:1] == [2] and worlds[-1:] == [3], worlds
        assert not [r for r in t.logs.events("resumed") if float(r["time"]) > at]
        assert steps_retrained(t.logs, at) == 0
        t.check_survivors(processes, lost=set(processes) - set(t.processes()))


def test_7_drain_waits_then_resumes_with_no_steps_lost(training: ChaosJob) -> None:
    t = training
    t.settle()
    before = t.counters()
    at = time.time()
    # Drains the workers off the node (the operator and the store stand for the on-demand
    # pool a real cluster keeps them on); cordoned, the job cannot get them back.
    t.k("drain", NODE, "--pod-selector", t.workers_selector, "--ignore-daemonsets",
        "--delete-emptydir-data", "--timeout=180s", timeout=240)
    wait_for("the job waiting below minReplicas",
             lambda: t.status().get("phase") == "Restarting", timeout=60)
    stalled = t.logs.max_step()
    time.sleep(5)
    t.k("uncordon", NODE)
    first = t.resumed_after(at)  # both modes: the whole group stopped, a checkpoint resumes it
    t.record("7-drain-uncordon", float(first["time"]) - at, waited_s=5)
    t.settle()
    assert t.counters() == (before[0] + 3, before[1])
    assert steps_lost_at(t.logs, at) == 0
    assert first["step"] - 1 <= stalled


def _operator_pods(t: ChaosJob) -> list[dict[str, Any]]:
    return list(t.k.json("get", "pods", "-n", OPERATOR_NAMESPACE, "-l",
                         "app.kubernetes.io/name=elastrain")["items"])


def test_8_operator_killed_during_a_recovery(training: ChaosJob) -> None:
    t = training
    t.settle()
    before = t.counters()
    pod = t.worker(1)
    processes = t.processes()
    at = t.evict(pod)
    operators = _operator_pods(t)
    for op in operators:
        t.k("delete", "pod", op["metadata"]["name"], "-n", OPERATOR_NAMESPACE, "--grace-period=0",
            "--force")
    # The kill landed mid-recovery: the evicted worker was still terminating (its finalizer is
    # the operator's to remove, once it has counted the loss).
    evicted = t.k("get", "pod", pod, "-n", t.ns, "-o", "json", check=False)
    assert evicted.returncode == 0 and json.loads(evicted.stdout)["metadata"].get(
        "deletionTimestamp"), "the evicted worker was gone before the operator was killed"
    first = t.recovered_after(at)
    t.record("8-operator-killed", float(first["time"]) - at, pod=pod,
             world_size=first["world_size"])
    t.settle()
    old = {op["metadata"]["uid"] for op in operators}
    assert all(op["metadata"]["uid"] not in old for op in _operator_pods(t)), \
        "the recovery was finished by the operator that was killed"
    assert t.counters() == (before[0] + 1, before[1])
    assert t.steps_lost(at) == 0
    t.check_survivors(processes, lost={pod})
    # Counted late by the new operator, the loss is still dated by the pod, so the resume that
    # answered it is recorded.
    wait_for("the recovery recorded by the new operator",
             lambda: (t.status().get("lastRecovery") or {}).get("pod") == pod)


def test_14_two_workers_killed_one_second_apart(training: ChaosJob) -> None:
    """Two losses without notice 1 s apart (workers 1 and 2 SIGKILLed; worker 0 is left alone,
    below minReplicas): the job trains on once the losses are handled (at min size or after
    the replacements), and each loss is counted exactly once: 2 failures, no preemption.
    InProcess: worker 0's group is gone and it alone is below min, so it saves its committed
    step alone and restarts in place; the replacements start with it from that save, so at
    most the step in flight is trained again (before, the job resumed from the last periodic
    checkpoint: up to INTERVAL_STEPS)."""
    t = training
    t.settle()
    before = t.counters()
    metrics_before = t.operator_metrics()
    pods = [t.worker(1), t.worker(2)]
    at = _sigkill(t, pods[0])
    time.sleep(1)
    second = _sigkill(t, pods[1])
    first = t.recovered_after(second)
    t.record("14-sigkill-two-workers-1s-apart", float(first["time"]) - at, pods=pods,
             second_kill_after_s=round(second - at, 2), resumed_from=first["step"] - 1,
             world_size=first["world_size"])
    wait_for("both failures counted", lambda: t.counters()[1] >= before[1] + 2, timeout=120)
    t.settle()
    assert t.counters() == (before[0], before[1] + 2)
    lost = t.steps_lost(at)
    print(f"[{t.mode}] steps lost: {lost}")
    if t.mode == INPROCESS:
        stops = [r for r in t.logs.events("stopping") if float(r["time"]) > at]
        assert stops and stops[0]["alone"] is True, stops
        assert lost <= 1
    assert lost <= INTERVAL_STEPS
    assert t.operator_metrics()[:2] == (metrics_before[0], metrics_before[1] + 2)
    assert event_reasons(t.k, t.ns, t.job).count("WorkerFailed") >= 2


WINDOW_S = 30  # how long scenario 15 watches the job train on without its replacement


def _unschedulable(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return pod.get("status", {}).get("phase") == "Pending" and any(
        c["type"] == "PodScheduled" and c["status"] == "False"
        and c.get("reason") == "Unschedulable" for c in conditions)


def test_15_the_replacement_never_comes(training: ChaosJob) -> None:
    """The node cordoned, then a worker evicted: its replacement stays Pending (unschedulable),
    and for WINDOW_S the job trains on at minReplicas (2) and stays Running, one preemption
    counted; in InProcess mode no survivor restarted. Uncordoned, it is back at full size."""
    t = training
    t.settle()
    before = t.counters()
    processes = t.processes()
    pod = t.worker(1)
    t.k("cordon", NODE)
    try:
        at = t.evict(pod)
        first = t.recovered_after(at)
        t.record("15-replacement-never-comes", float(first["time"]) - at, pod=pod,
                 resumed_from=first["step"] - 1, world_size=first["world_size"])
        wait_for("the preemption counted", lambda: t.counters()[0] == before[0] + 1)
        wait_for("the replacement pending, unschedulable", lambda: [
            p for p in t.workers() if p["metadata"]["name"] not in processes
            and _unschedulable(p)], timeout=60)
        mark = time.time()
        while time.time() < mark + WINDOW_S:
            status = t.status()
            assert status.get("phase") == "Running", status
            assert status.get("readyReplicas") == 2, status
            new = [p for p in t.workers() if p["metadata"]["name"] not in processes]
            assert new and all(_unschedulable(p) for p in new), "the replacement was placed"
            time.sleep(2)
        steps = [r for r in t.logs.events("step") if mark < float(r["time"]) <= mark + WINDOW_S]
        assert len(steps) >= 10 and {r["world_size"] for r in steps} == {2}, steps[-3:]
        assert t.counters() == (before[0] + 1, before[1])
        assert t.steps_lost(at) == 0
        t.check_survivors(processes, lost={pod})
    finally:
        t.k("uncordon", NODE)
    t.settle()
    assert t.counters() == (before[0] + 1, before[1])
