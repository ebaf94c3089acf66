"""Growing under real Kueue (v0.17.0, its ElasticJobsViaWorkloadSlices gate on) by workload
slices, with the operator as a process told so (ELASTRAIN_KUEUE_SLICES, policy.kueue_slices): a
job admitted below its size asks for the rest with a slice that is to replace its Workload; when
Kueue admits it (finishing the old one) the job grows without touching the workers it has, and
the old slice goes. Preempted afterwards, the job is evicted whole, as one Workload. No kubelet:
the tier's FakeKubelet confirms deletions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from elastrain_operator.render.workload import REPLACEMENT_FOR
from tests.integration.kueue.fixtures import (
    KueueQueues,
    admitted,
    condition,
    make_workload,
    wait_for,
)
from tests.integration.kueue.jobs import below_its_size, raise_quota
from tests.integration.operator.conftest import Cluster, Operator

pytestmark = pytest.mark.cluster
Manifest = dict[str, Any]


@pytest.fixture(autouse=True)
def slices_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Before the operator starts (autouse fixtures come first): it grows by slices."""
    monkeypatch.setenv("ELASTRAIN_KUEUE_SLICES", "true")
    yield


def job_workloads(kq: KueueQueues) -> dict[str, Manifest]:
    return {wl["metadata"]["name"]: wl for wl in kq.workloads()
            if any(o["kind"] == "TrainingJob" for o in wl["metadata"].get("ownerReferences", []))}


def test_a_job_admitted_below_its_size_grows_by_a_workload_slice_that_replaces_its_own(
        kueue_queues: KueueQueues, kcluster: Cluster, kueue_operator: Operator) -> None:
    kq = kueue_queues
    queue, high, first = below_its_size(kq, kcluster)

    def replaces(wl: Manifest) -> str | None:
        return (wl["metadata"].get("annotations") or {}).get(REPLACEMENT_FOR)

    def the_slice() -> Manifest | None:
        return next((wl for wl in job_workloads(kq).values() if replaces(wl)), None)

    # The admitted one (the slice may already be there: the operator asks for it as soon as
    # the two workers run, which CI saw before this line).
    (name,) = [n for n, wl in job_workloads(kq).items() if not replaces(wl)]

    pending = wait_for("the slice, waiting", lambda: (s := the_slice()) and condition(
        s, "QuotaReserved") and s, timeout=60)
    assert pending["metadata"]["annotations"][REPLACEMENT_FOR] == f"{kq.namespace}/{name}"
    workers = pending["spec"]["podSets"][0]
    assert (workers["name"], workers["count"]) == ("workers", 3)
    assert pending["spec"]["priority"] == 100
    assert not any(n.endswith("-more") for n in job_workloads(kq))  # no extra Workload
    uids = {n: p["metadata"]["uid"] for n, p in kcluster.pods("demo").items()}

    # More quota: Kueue admits the slice in place of the first Workload; the job grows to 3,
    # the two it had kept, and the replaced Workload goes.
    raise_quota(kq, "1600m")
    kcluster.wait_workers([*first, "demo-worker-2-0"], timeout=60)
    assert {n: p["metadata"]["uid"] for n, p in kcluster.pods("demo").items()
            if n in first} == uids
    kcluster.run_all("demo")
    grown = pending["metadata"]["name"]
    wait_for("the job on the slice, 3 admitted workers", lambda: (
        (q := kcluster.status("demo")["queue"]).get("admittedWorkers") == 3
        and q.get("workload") == grown))
    wait_for("the replaced Workload gone", lambda: set(job_workloads(kq)) == {grown})
    assert admitted(job_workloads(kq)[grown])
    status = kcluster.status("demo")
    assert (status["phase"], status["preemptions"], status["restarts"]) == ("Running", 0, 0)

    # A more urgent Workload that needs 500m: Kueue evicts the job whole (one Workload now),
    # its pods stop and the quota is released.
    kq.create_workload(make_workload("urgent", queue=queue, cpu="500m", priority=(high, 1000)))
    wait_for("the urgent Workload admitted", lambda: admitted(kq.workload("urgent")), timeout=90)
    wait_for("the job stopped", lambda: not kcluster.worker_names("demo"))
    ours = job_workloads(kq)[grown]
    assert (condition(ours, "Requeued") or {}).get("status") == "True", ours
