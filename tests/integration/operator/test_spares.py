"""Warm spares on a real apiserver: desired + spares worker pods, the desired world told to the
trainers in the poll, and readySpares kept by the status schema (one round, no operator)."""

from __future__ import annotations

import pytest

from elastrain_operator.reconcile import Options, reconcile_once
from tests.integration.operator.conftest import Cluster
from tests.stand_in_progress import StandInProgress

pytestmark = pytest.mark.cluster


def test_spares_are_worker_pods_and_ready_spares_reach_status(cluster: Cluster) -> None:
    # Two trainers on the same port: members at 127.0.0.1, the spare at 127.0.0.2.
    members = StandInProgress({"step": 5, "totalSteps": 10, "role": "member"})
    spare = StandInProgress({"step": 0, "totalSteps": 10, "role": "spare"},
                            host="127.0.0.2", port=members.port)
    try:
        cluster.create_job(replicas=2, recovery={"mode": "InProcess"}, spares=1,
                           metricsPort=members.port)
        assert reconcile_once(cluster.kube, cluster.ns, "demo", Options()) == "success"
        assert cluster.worker_names() == ["demo-worker-0-0", "demo-worker-1-0",
                                          "demo-worker-2-0"]
        env = {e["name"]: e.get("value") for e in cluster.pods()["demo-worker-2-0"]["spec"][
            "containers"][0]["env"]}
        assert (env["ELASTRAIN_REPLICAS"], env["ELASTRAIN_SPARES"]) == ("2", "1")
        cluster.run("demo-worker-0-0")
        cluster.run("demo-worker-1-0")
        cluster.run("demo-worker-2-0", ip="127.0.0.2")
        assert reconcile_once(cluster.kube, cluster.ns, "demo",
                              Options(poll_progress=True)) == "success"
    finally:
        members.close()
        spare.close()
    assert members.paths == ["/progress?replicas=2"] * 2
    assert spare.paths == ["/progress?replicas=2"]
    status = cluster.status()
    assert (status["replicas"], status["readyReplicas"], status["readySpares"],
            status["workers"]) == (2, 2, 1, "2/2")
    assert status["progress"]["step"] == 5
    columns = cluster.kubectl("get", "tj", "demo").stdout.splitlines()[1].split()
    assert columns[:4] == ["demo", "Running", "2/2", "5"]
