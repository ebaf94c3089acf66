"""Scenario 4: a SIGTERM checkpoint that takes longer than 30 seconds still commits when the
job's terminationGracePeriodSeconds allows it, and the replacement resumes from it; in InProcess
mode, the save of a drain below minReplicas.

The object store is slowed, not the model grown: a proxy on the pod bridge in front of MinIO
delays every response by DELAY seconds, so the dozen requests of one save take well over 30 s.
Periodic checkpoints are off, so the SIGTERM save is the only one. The store is slow only from
the eviction until that save committed: the start and the resume, which read it, are not what
these tests are about and took two thirds of their time through it.
"""

from __future__ import annotations

import time
from urllib.parse import urlparse

from tests.e2e.conftest import NodeCluster
from tests.e2e.slow_store import SlowStoreProxy
from tests.e2e.support import (
    ARTIFACTS,
    INPROCESS,
    RESTART,
    LogCollector,
    Training,
    evict,
    first_step_after,
    job_status,
    make_job,
    record_recovery,
    recovery_spec,
    steps_lost_at,
    wait_for,
)

GRACE_SECONDS = 180
DELAY = 4.0


def test_4_slow_sigterm_save_commits_within_the_grace_period(operator: NodeCluster,
                                                              job_namespace: str) -> None:
    node, ns, k = operator, job_namespace, operator.kubectl
    minio = urlparse(node.s3.endpoint_url)
    assert minio.hostname and minio.port
    with SlowStoreProxy(node.node_ip, (minio.hostname, minio.port), 0.0) as proxy:
        job = make_job("slow", ns, image=node.images["trainer"], steps=100_000,
                       s3_endpoint=proxy.endpoint, bucket=node.s3.bucket, interval_steps=0,
                       grace_seconds=GRACE_SECONDS, **recovery_spec(RESTART))
        job["spec"]["checkpoint"]["async"] = False
        k.apply(job)
        workers = "elastrain.dev/job-name=slow,elastrain.dev/role=worker"
        with LogCollector(k, ns, workers, ARTIFACTS / "slow") as logs:
            logs.wait_for_step(10, timeout=400)
            pod = f"slow-worker-1-{job_status(k, ns, 'slow')['slots'][1]['attempt']}"
            proxy.delay = DELAY
            at = evict(k, ns, pod)
            saved = wait_for("the SIGTERM checkpoint committed",
                             lambda: [r for r in logs.events("checkpoint_saved")
                                      if float(r["time"]) > at], timeout=GRACE_SECONDS)
            proxy.delay = 0.0
            first = wait_for("a step after the resume", lambda: first_step_after(logs, at),
                             timeout=300)
            record_recovery("4-slow-sigterm-save", float(first["time"]) - at, pod=pod,
                            save_seconds=saved[0]["total_s"])
            assert saved[0]["total_s"] > 30, saved
            assert first["step"] - 1 == saved[0]["step"]
            assert steps_lost_at(logs, at) == 0
            status = job_status(k, ns, "slow")
            assert (status["preemptions"], status["restarts"]) == (1, 0)


def test_4_inprocess_a_drain_below_min_saves_through_a_slow_store_within_the_grace_period(
        operator: NodeCluster, job_namespace: str) -> None:
    """Scenario 4 in InProcess mode. A leave that keeps minReplicas saves nothing there (the
    survivors hold the state), so the save this scenario slows is the one a drain below the
    smallest world makes: two of the three workers evicted together (min 2), every node saves
    the step on the old group through the slowed store, the evicted ones then exit 0 and the
    other restarts in place; the new generation resumes from that save."""
    node, ns, k = operator, job_namespace, operator.kubectl
    minio = urlparse(node.s3.endpoint_url)
    assert minio.hostname and minio.port
    with SlowStoreProxy(node.node_ip, (minio.hostname, minio.port), 0.0) as proxy:
        job = make_job("slow-ip", ns, image=node.images["trainer"], steps=100_000,
                       s3_endpoint=proxy.endpoint, bucket=node.s3.bucket, interval_steps=0,
                       grace_seconds=GRACE_SECONDS, recovery={"mode": INPROCESS})
        job["spec"]["checkpoint"]["async"] = False
        k.apply(job)
        with LogCollector(k, ns, Training.worker_selector("slow-ip"),
                          ARTIFACTS / "slow-ip") as logs:
            t = Training(k, ns, "slow-ip", logs, INPROCESS)
            t.settle()
            pods = [t.worker(1), t.worker(2)]
            proxy.delay = DELAY
            at = time.time()
            for pod in pods:
                evict(k, ns, pod)
            saved = wait_for("the drain's checkpoint committed",
                             lambda: [r for r in logs.events("checkpoint_saved")
                                      if float(r["time"]) > at], timeout=GRACE_SECONDS)
            proxy.delay = 0.0
            first = wait_for("a step after the resume", lambda: first_step_after(logs, at),
                             timeout=300)
            record_recovery("4-slow-drain-save", float(first["time"]) - at, mode=INPROCESS,
                            pod=",".join(pods), save_seconds=saved[0]["total_s"])
            stops = [r for r in logs.events("stopping") if float(r["time"]) > at]
            assert stops and all(r.get("reason") == "below the smallest world" for r in stops)
            assert saved[0]["total_s"] > 30, saved
            assert first["step"] - 1 == saved[0]["step"]
            assert steps_lost_at(logs, at) == 0
            wait_for("both preemptions counted", lambda: t.counters()[0] == 2)
            time.sleep(5)
            assert t.counters() == (2, 0)
