"""Warm spares on a real apiserver: desired + spares worker pods, the desired world told to the
trainers on the control channel with the job's token (its Secret created with the first pods,
mounted by each), and readySpares kept by the status schema (one round, no operator)."""

from __future__ import annotations

import base64

import pytest

from elastrain_operator.control import job_token
from elastrain_operator.k8s.client import namespaced
from elastrain_operator.reconcile import Options, reconcile_once
from tests.integration.operator.conftest import Cluster
from tests.stand_in_progress import StandInProgress

pytestmark = pytest.mark.cluster


def test_spares_are_worker_pods_and_ready_spares_reach_status(cluster: Cluster) -> None:
    key = b"the operator's key, 32 characters or more"
    options = Options(control_key=key)
    # Two trainers on the same port: members at 127.0.0.1, the spare at 127.0.0.2; each holds
    # the token the Secret below does (checked there).
    members = StandInProgress({"step": 5, "totalSteps": 10, "role": "member"})
    spare = StandInProgress({"step": 0, "totalSteps": 10, "role": "spare"},
                            host="127.0.0.2", port=members.port)
    try:
        job = cluster.create_job(replicas=2, recovery={"mode": "InProcess"}, spares=1,
                                 metricsPort=members.port)
        token = members.token = spare.token = job_token(key, job["metadata"]["uid"])
        assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
        assert cluster.worker_names() == ["demo-worker-0-0", "demo-worker-1-0",
                                          "demo-worker-2-0"]
        secret = cluster.kube.get(namespaced("v1", cluster.ns, "secrets", "demo-control"))
        assert secret is not None
        assert base64.b64decode(secret["data"]["token"]).decode() == token
        assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
        for pod in cluster.pods().values():
            spec = pod["spec"]
            (volume,) = [v for v in spec["volumes"] if "secret" in v]
            assert volume["secret"]["secretName"] == "demo-control"
            (mount,) = [m for m in spec["containers"][0]["volumeMounts"]
                        if m["name"] == volume["name"]]
            env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
            assert env["ELASTRAIN_CONTROL_TOKEN_FILE"] == f"{mount['mountPath']}/token"
        assert (env["ELASTRAIN_REPLICAS"], env["ELASTRAIN_SPARES"]) == ("2", "1")
        cluster.run("demo-worker-0-0")
        cluster.run("demo-worker-1-0")
        cluster.run("demo-worker-2-0", ip="127.0.0.2")
        assert reconcile_once(cluster.kube, cluster.ns, "demo",
                              Options(poll_progress=True, control_key=key)) == "success"
    finally:
        members.close()
        spare.close()
    assert members.paths == ["POST /control"] * 2 and members.told == [2, 2]
    assert spare.paths == ["POST /control"] and spare.told == [2]
    status = cluster.status()
    assert (status["replicas"], status["readyReplicas"], status["readySpares"],
            status["workers"]) == (2, 2, 1, "2/2")
    assert status["progress"]["step"] == 5
    columns = cluster.kubectl("get", "tj", "demo").stdout.splitlines()[1].split()
    assert columns[:4] == ["demo", "Running", "2/2", "5"]
