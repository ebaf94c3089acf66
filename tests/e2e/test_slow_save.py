"""Scenario 4: a SIGTERM checkpoint that takes longer than 30 seconds still commits when the
job's terminationGracePeriodSeconds allows it, and the replacement resumes from it; in InProcess
mode, the save of a drain below minReplicas.

The object store is slowed, not the model grown: a proxy on the pod bridge in front of MinIO
delays every response by DELAY seconds, so the dozen requests of one save take well over 30 s.
Periodic checkpoints are off, so the SIGTERM save is the only one. The store is slow only from
the eviction until that save committed: the start and the resume, which read it, are not what
these tests are about and took two thirds of their time through it. Both modes' jobs run side
by side, each behind a proxy of its own: the test is mostly waiting on slowed responses.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any
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


def test_4_slow_saves_commit_within_the_grace_period(operator: NodeCluster,
                                                    job_namespace: str) -> None:
    """Restart: a worker evicted, its SIGTERM save takes over 30 s and the replacement resumes
    from it. InProcess: a leave that keeps minReplicas saves nothing there (the survivors hold
    the state), so the save this scenario slows is the one a drain below the smallest world
    makes: two of the three workers evicted together (min 2), every node saves the step on the
    old group through the slowed store, the evicted ones then exit 0 and the other restarts in
    place; the new generation resumes from that save."""
    node, ns, k = operator, job_namespace, operator.kubectl
    minio = urlparse(node.s3.endpoint_url)
    assert minio.hostname and minio.port
    with contextlib.ExitStack() as stack:
        proxies = {mode: stack.enter_context(
            SlowStoreProxy(node.node_ip, (minio.hostname, minio.port), 0.0))
            for mode in (RESTART, INPROCESS)}
        restart = make_job("slow", ns, image=node.images["trainer"], steps=100_000,
                           s3_endpoint=proxies[RESTART].endpoint, bucket=node.s3.bucket,
                           interval_steps=0, grace_seconds=GRACE_SECONDS,
                           **recovery_spec(RESTART))
        inprocess = make_job("slow-ip", ns, image=node.images["trainer"], steps=100_000,
                             s3_endpoint=proxies[INPROCESS].endpoint, bucket=node.s3.bucket,
                             interval_steps=0, grace_seconds=GRACE_SECONDS,
                             recovery={"mode": INPROCESS})
        for job in (restart, inprocess):
            job["spec"]["checkpoint"]["async"] = False
            k.apply(job)
        logs = {RESTART: stack.enter_context(LogCollector(
                    k, ns, "elastrain.dev/job-name=slow,elastrain.dev/role=worker",
                    ARTIFACTS / "slow")),
                INPROCESS: stack.enter_context(LogCollector(
                    k, ns, Training.worker_selector("slow-ip"), ARTIFACTS / "slow-ip"))}
        t = Training(k, ns, "slow-ip", logs[INPROCESS], INPROCESS)

        logs[RESTART].wait_for_step(10, timeout=400)
        t.settle()
        victims = {RESTART: [f"slow-worker-1-{job_status(k, ns, 'slow')['slots'][1]['attempt']}"],
                   INPROCESS: [t.worker(1), t.worker(2)]}
        at: dict[str, float] = {}
        for mode, pods in victims.items():
            proxies[mode].delay = DELAY
            at[mode] = time.time()
            for pod in pods:
                evict(k, ns, pod)

        def committed(mode: str) -> list[dict[str, Any]]:
            return [r for r in logs[mode].events("checkpoint_saved")
                    if float(r["time"]) > at[mode]]

        def saves() -> dict[str, dict[str, Any]] | None:
            # Each store turns fast again once its save committed: the resume reads it.
            for mode, proxy in proxies.items():
                if proxy.delay and committed(mode):
                    proxy.delay = 0.0
            return ({mode: committed(mode)[0] for mode in proxies}
                    if not any(p.delay for p in proxies.values()) else None)

        saved = wait_for("both SIGTERM checkpoints committed", saves, timeout=GRACE_SECONDS)
        def resumed(mode: str) -> Callable[[], dict[str, Any] | None]:
            return lambda: first_step_after(logs[mode], at[mode])

        first = {mode: wait_for(f"{mode}: a step after the resume", resumed(mode), timeout=300)
                 for mode in proxies}
        record_recovery("4-slow-sigterm-save", float(first[RESTART]["time"]) - at[RESTART],
                        pod=victims[RESTART][0], save_seconds=saved[RESTART]["total_s"])
        record_recovery("4-slow-drain-save", float(first[INPROCESS]["time"]) - at[INPROCESS],
                        mode=INPROCESS, pod=",".join(victims[INPROCESS]),
                        save_seconds=saved[INPROCESS]["total_s"])
        for mode in proxies:
            assert saved[mode]["total_s"] > 30, (mode, saved[mode])
            assert first[mode]["step"] - 1 == saved[mode]["step"], (mode, first, saved)
            assert steps_lost_at(logs[mode], at[mode]) == 0, mode
        status = job_status(k, ns, "slow")
        assert (status["preemptions"], status["restarts"]) == (1, 0)
        stops = [r for r in logs[INPROCESS].events("stopping") if float(r["time"]) > at[INPROCESS]]
        assert stops and all(r.get("reason") == "below the smallest world" for r in stops)
        wait_for("both preemptions counted", lambda: t.counters()[0] == 2)
        time.sleep(5)
        assert t.counters() == (2, 0)
