"""Growing under real Kueue (v0.17.0) with the default feature gates (no workload slices), with
the operator as a process (policy.kueue_grow): a job admitted below its size asks for the rest
with an extra Workload; when Kueue admits it the job grows without touching the workers it has;
when Kueue preempts it (it is the job's most recent admission, so it goes first) its worker
leaves, its quota is given back and it waits in the queue again, while the job's own admission
and workers stay. No kubelet: the tier's FakeKubelet confirms deletions."""

from __future__ import annotations

from typing import Any

import pytest

from elastrain_operator.k8s.client import namespaced
from tests.integration.kueue.fixtures import (
    KUEUE,
    KueueQueues,
    admitted,
    condition,
    make_workload,
    wait_for,
)
from tests.integration.kueue.jobs import below_its_size, raise_quota, workload_of
from tests.integration.operator.conftest import Cluster, Operator

pytestmark = pytest.mark.cluster
Manifest = dict[str, Any]


def extra_of(kq: KueueQueues) -> Manifest | None:
    return next((wl for wl in kq.workloads() if wl["metadata"]["name"].endswith("-more")), None)


def test_a_job_admitted_below_its_size_grows_by_an_extra_workload_preempted_on_its_own(
        kueue_queues: KueueQueues, kcluster: Cluster, kueue_operator: Operator) -> None:
    kq = kueue_queues
    queue, high, first = below_its_size(kq, kcluster)
    extra = wait_for("the extra Workload, waiting", lambda: (e := extra_of(kq)) and condition(
        e, "QuotaReserved") and e, timeout=60)
    assert [(s["name"], s["count"]) for s in extra["spec"]["podSets"]] == [("workers", 1)]
    assert extra["spec"]["priority"] == 100
    uids = {n: p["metadata"]["uid"] for n, p in kcluster.pods("demo").items()}

    # More quota: Kueue admits the extra Workload and the job grows to 3, the two it had kept.
    raise_quota(kq, "1600m")
    kcluster.wait_workers([*first, "demo-worker-2-0"], timeout=60)
    assert {n: p["metadata"]["uid"] for n, p in kcluster.pods("demo").items()
            if n in first} == uids
    kcluster.run_all("demo")
    wait_for("3 admitted workers", lambda: kcluster.status("demo")["queue"].get(
        "admittedWorkers") == 3)

    # A more urgent Workload that fits once 500m is free: Kueue preempts the extra Workload,
    # its worker leaves, its quota goes back; the job's own admission and workers stay.
    kq.create_workload(make_workload("urgent", queue=queue, cpu="500m", priority=(high, 1000)))
    wait_for("the urgent Workload admitted", lambda: admitted(kq.workload("urgent")), timeout=90)
    assert sorted(kcluster.worker_names("demo")) == first
    extra = extra_of(kq)
    assert extra is not None and extra["status"].get("admission") is None, extra
    assert (condition(extra, "Requeued") or {}).get("status") == "True", extra
    ours = workload_of(kq, "demo")
    assert ours is not None and admitted(ours) and condition(ours, "Evicted") is None, ours
    status = kcluster.status("demo")
    assert (status["phase"], status["preemptions"], status["restarts"]) == ("Running", 0, 0)

    # The urgent one done: the extra Workload is admitted again and the job grows back.
    kq.kube.delete(namespaced(KUEUE, kq.namespace, "workloads", "urgent"))
    kcluster.wait_workers([*first, "demo-worker-2-1"], timeout=90)
