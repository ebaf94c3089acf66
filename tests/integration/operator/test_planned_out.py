"""A pod the in-process world planned out (issue 34 item 4; policy.replace), on a real
apiserver: the members' control answers name it, and the operator counts it once as a failure,
force-deletes it (bound to a node whose kubelet never answers, a graceful delete would leave it
Terminating) and creates its replacement in the same round."""

from __future__ import annotations

import pytest

from elastrain_operator.control import job_token
from elastrain_operator.reconcile import Options, reconcile_once
from tests.integration.operator.conftest import Cluster, wait_for
from tests.stand_in_progress import StandInProgress

pytestmark = pytest.mark.cluster


def test_a_planned_out_pod_is_force_deleted_replaced_and_counted_once(cluster: Cluster) -> None:
    key = b"the operator's key, 32 characters or more"
    # Workers 0 and 1 answer at 127.0.0.1; worker 2 went dark (nothing answers at 127.0.0.3).
    members = StandInProgress({"step": 40, "totalSteps": 100, "worldSize": 2,
                               "role": "member", "plannedOut": {"demo-worker-2-0": 20.0}})
    try:
        job = cluster.create_job(replicas=3, minReplicas=2, recovery={"mode": "InProcess"},
                                 metricsPort=members.port)
        members.token = job_token(key, job["metadata"]["uid"])
        assert reconcile_once(cluster.kube, cluster.ns, "demo",
                              Options(control_key=key)) == "success"
        names = ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]
        assert cluster.worker_names() == names
        # Scheduled (the premise: a bound pod is its node's kubelet's to end, and this tier's
        # nodes have none), then running.
        wait_for("the workers scheduled", lambda: all(
            p["spec"].get("nodeName") for p in cluster.pods().values()) or None)
        for name, ip in zip(names, ("127.0.0.1", "127.0.0.1", "127.0.0.3"), strict=True):
            cluster.run(name, ip=ip)
        assert cluster.kubelet is not None
        cluster.kubelet.dark.add("demo-worker-2-0")  # its node's kubelet confirms nothing
        assert reconcile_once(cluster.kube, cluster.ns, "demo",
                              Options(poll_progress=True, control_key=key)) == "success"
    finally:
        members.close()
    assert members.paths == ["POST /control"] * 2
    # Gone, not Terminating: a graceful delete would wait for its node's kubelet forever.
    assert sorted(cluster.pods(live=False)) == ["demo-worker-0-0", "demo-worker-1-0",
                                                "demo-worker-2-1"]
    status = cluster.status()
    assert (status["restarts"], status["preemptions"]) == (1, 0)
    (loss,) = status["recentLosses"]
    assert (loss["pod"], loss["kind"]) == ("demo-worker-2-0", "Failed")
    assert loss["reason"].startswith("planned out by the in-process world 20s ago")
    events = [e["message"] for e in cluster.events("WorkerFailed")]
    assert any("planned out" in m and "force-deleted" in m for m in events), events
