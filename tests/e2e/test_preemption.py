"""Scenarios 1-3 and 5-8 of the e2e suite, on one long-running TrainingJob (3 workers, min 2,
DDP over gloo, checkpoints to MinIO on the pod bridge), in order. Each scenario reads the counter
deltas it causes from the job's status and events, and training continuity from the trainers'
own records (step, resumed-from step), and records its recovery time (worker lost -> first
training step after the resume) in runs/e2e/recovery.json.

One job for all of them because starting three torch workers costs a minute on two cores; each
scenario first waits until the job is back at full size and training.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import OPERATOR_NAMESPACE, NamespacePool, NodeCluster
from tests.e2e.support import (
    ARTIFACTS,
    LogCollector,
    Training,
    event_reasons,
    make_job,
    record_recovery,
    scrape,
    steps_lost_at,
    wait_for,
)

JOB = "chaos"
INTERVAL_STEPS = 20
WORKERS = Training.worker_selector(JOB)


class ChaosJob(Training):
    """The module's job, and the operator's own counters of it."""

    def operator_metrics(self) -> tuple[float, float, float]:
        """(preemptions_total, restarts_total, training recoveries observed) from the operator
        pod's /metrics; this job is the only one losing workers while the module runs."""
        pods = self.k.json("get", "pods", "-n", OPERATOR_NAMESPACE, "-l",
                           "app.kubernetes.io/name=elastrain")["items"]
        (ip,) = [p["status"]["podIP"] for p in pods if p["status"].get("phase") == "Running"
                 and not p["metadata"].get("deletionTimestamp")]
        m = scrape(f"http://{ip}:9090/metrics")
        return (m["elastrain_operator_preemptions_total"], m["elastrain_operator_restarts_total"],
                m["elastrain_operator_training_recovery_seconds_count"])


@pytest.fixture(scope="module")
def training(operator: NodeCluster, namespace_pool: NamespacePool) -> Iterator[ChaosJob]:
    k = operator.kubectl
    ns = namespace_pool.take()  # held by this module's one job throughout
    k.apply(make_job(JOB, ns, image=operator.images["trainer"], steps=100_000,
                     s3_endpoint=operator.s3.endpoint_url, bucket=operator.s3.bucket,
                     interval_steps=INTERVAL_STEPS))
    with LogCollector(k, ns, WORKERS, ARTIFACTS / "chaos") as logs:
        t = ChaosJob(k, ns, JOB, logs)
        t.settle()
        yield t
    namespace_pool.give_back(ns)


def _preempt_and_check(t: ChaosJob, index: int, scenario: str) -> None:
    t.settle()
    before = t.counters()
    metrics_before = t.operator_metrics()
    pod = t.worker(index)
    at = t.evict(pod)
    first = t.resumed_after(at)
    record_recovery(scenario, float(first["time"]) - at, pod=pod,
                    resumed_from=first["step"] - 1)
    # The pod the operator saw: preempted (DisruptionTarget), never a failure.
    wait_for("the preemption counted", lambda: t.counters()[0] == before[0] + 1)
    t.settle()
    assert t.counters() == (before[0] + 1, before[1])
    assert steps_lost_at(t.logs, at) == 0, "the SIGTERM checkpoint lost steps"
    assert "WorkerPreempted" in event_reasons(t.k, t.ns, JOB)
    wait_for("the recovery in the operator's metrics",
             lambda: t.operator_metrics()[2] == metrics_before[2] + 1)
    assert t.operator_metrics()[:2] == (metrics_before[0] + 1, metrics_before[1])
    assert t.status()["lastRecovery"]["pod"] == pod


def test_1_evicted_worker_resumes_from_its_sigterm_checkpoint(training: ChaosJob) -> None:
    _preempt_and_check(training, 1, "1-evict-worker-1")


def test_2_evicting_worker_0_loses_no_rendezvous(training: ChaosJob) -> None:
    _preempt_and_check(training, 0, "2-evict-worker-0")


def _container_pid(t: ChaosJob, pod: str) -> int:
    status = t.k.json("get", "pod", pod, "-n", t.ns)["status"]
    container_id = status["containerStatuses"][0]["containerID"].split("://", 1)[1]
    pid_file = Path("/run/elastrain-node/containerd/io.containerd.runtime.v2.task/k8s.io",
                    container_id, "init.pid")
    return int(pid_file.read_text())


def test_3_sigkilled_worker_recovers_within_the_checkpoint_interval(training: ChaosJob) -> None:
    t = training
    t.settle()
    before = t.counters()
    metrics_before = t.operator_metrics()
    pod = t.worker(2)
    at = time.time()
    os.kill(_container_pid(t, pod), signal.SIGKILL)  # no notice: the whole container dies
    first = t.resumed_after(at)
    record_recovery("3-sigkill-worker-2", float(first["time"]) - at, pod=pod,
                    resumed_from=first["step"] - 1)
    # An exit the trainer did not choose (137, no DisruptionTarget) is a failure by policy.
    wait_for("the failure counted", lambda: t.counters()[1] == before[1] + 1)
    t.settle()
    assert t.counters() == (before[0], before[1] + 1)
    assert steps_lost_at(t.logs, at) <= INTERVAL_STEPS
    assert "WorkerFailed" in event_reasons(t.k, t.ns, JOB)
    assert t.operator_metrics()[:2] == (metrics_before[0], metrics_before[1] + 1)


def _store(t: ChaosJob) -> dict[str, Any] | None:
    done = t.k("get", "pod", f"{JOB}-rdzv", "-n", t.ns, "-o", "json", check=False)
    return json.loads(done.stdout) if done.returncode == 0 else None


def _ready(pod: dict[str, Any] | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_5_lost_rendezvous_store_is_recreated_without_a_failure(training: ChaosJob) -> None:
    """Every torchrun agent exits when the store goes (c10d rendezvous state lives only there);
    the operator recreates the store, counts each such worker as preempted (never a failure),
    replaces it, and training resumes from the checkpoint the agents' SIGTERM made."""
    t = training
    t.settle()
    before = t.counters()
    old = _store(t)
    assert old is not None
    at = time.time()
    t.k("delete", "pod", f"{JOB}-rdzv", "-n", t.ns, "--wait=false")
    wait_for("a new store pod, Ready", lambda: (new := _store(t)) is not None and _ready(new)
             and new["metadata"]["uid"] != old["metadata"]["uid"], timeout=120)
    first = t.resumed_after(at)
    record_recovery("5-store-pod-deleted", float(first["time"]) - at)
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
    t.k("scale", "trainingjob", JOB, "-n", t.ns, "--replicas=2")
    t.settle(replicas=2)
    t.k("scale", "trainingjob", JOB, "-n", t.ns, "--replicas=3")
    t.settle(replicas=3)
    assert t.counters() == before, "a scale event was counted as a loss"
    worlds = [int(r["world_size"]) for r in t.logs.events("resumed")]
    assert worlds[-2:] == [2, 3]


def test_7_drain_waits_then_resumes_with_no_steps_lost(training: ChaosJob) -> None:
    t = training
    t.settle()
    before = t.counters()
    at = time.time()
    # Drains the workers off the node (the operator and the store stand for the on-demand
    # pool a real cluster keeps them on); cordoned, the job cannot get them back.
    t.k("drain", "elastrain-node", "--pod-selector", WORKERS, "--ignore-daemonsets",
        "--delete-emptydir-data", "--timeout=180s", timeout=240)
    wait_for("the job waiting below minReplicas",
             lambda: t.status().get("phase") == "Restarting", timeout=60)
    stalled = t.logs.max_step()
    time.sleep(5)
    t.k("uncordon", "elastrain-node")
    first = t.resumed_after(at)
    record_recovery("7-drain-uncordon", float(first["time"]) - at, waited_s=5)
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
    first = t.resumed_after(at)
    record_recovery("8-operator-killed", float(first["time"]) - at, pod=pod)
    t.settle()
    old = {op["metadata"]["uid"] for op in operators}
    assert all(op["metadata"]["uid"] not in old for op in _operator_pods(t)), \
        "the recovery was finished by the operator that was killed"
    assert t.counters() == (before[0] + 1, before[1])
    assert steps_lost_at(t.logs, at) == 0
    # Counted late by the new operator, the loss is still dated by the pod, so the resume that
    # answered it is recorded.
    wait_for("the recovery recorded by the new operator",
             lambda: (t.status().get("lastRecovery") or {}).get("pod") == pod)
