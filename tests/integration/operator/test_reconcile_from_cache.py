"""A round starts from the watch's copy of the job (no GET); a stale copy must never win.

reconcile_once() is called directly against the real apiserver, with a Cache holding a copy
of the job that the apiserver has since moved past, as a watch that lags would.
"""

from __future__ import annotations

import pytest

from elastrain_operator.k8s.cache import Cache
from elastrain_operator.reconcile import Options, reconcile_once
from tests.integration.operator.conftest import Cluster
from tests.stand_in_progress import StandInProgress

pytestmark = pytest.mark.cluster


def test_a_stale_copy_loses_the_status_race_and_the_round_reads_fresh(cluster: Cluster) -> None:
    stale = cluster.create_job("stale")
    cache = Cache()
    cache.put_job(stale)
    # Another writer (a peer replica before it was paused) counted a loss after our copy.
    fresh = cluster.job("stale")
    assert fresh is not None
    cluster.kube.request("PUT", cluster.job_path("stale") + "/status",
                         body={**fresh, "status": {"preemptions": 7}})

    assert reconcile_once(cluster.kube, cluster.ns, "stale", Options(cache=cache)) == "success"

    status = cluster.status("stale")
    assert status.get("preemptions") == 7, "the stale copy's status overwrote a newer count"
    assert status.get("phase"), "the round that read the job fresh wrote no status"
    assert len(cluster.pods("stale")) == 2


def test_a_job_deleted_behind_the_copy_gets_no_children(cluster: Cluster) -> None:
    gone = cluster.create_job("gone")
    cache = Cache()
    cache.put_job(gone)
    cluster.kube.delete(cluster.job_path("gone"))
    assert cluster.job("gone") is None

    assert reconcile_once(cluster.kube, cluster.ns, "gone", Options(cache=cache)) == "success"

    assert cluster.pods("gone", live=False) == {}
    assert cluster.pods("gone", role="store", live=False) == {}


def test_what_a_round_polled_survives_its_lost_status_race(cluster: Cluster) -> None:
    trainer = StandInProgress({"step": 0, "totalSteps": 10, "checkpointHealth": {
        "consecutiveFailures": 1, "lastError": "SignatureDoesNotMatch: check the Secret"}},
        answers=1)
    try:
        cluster.create_job("polled", replicas=1, metricsPort=trainer.port)
        assert reconcile_once(cluster.kube, cluster.ns, "polled", Options()) == "success"
        cluster.run_all("polled")  # the worker is Running and Ready "at" 127.0.0.1
        stale = cluster.job("polled")
        assert stale is not None
        cache = Cache()
        cache.put_job(stale)
        fresh = cluster.job("polled")
        assert fresh is not None
        cluster.kube.request("PUT", cluster.job_path("polled") + "/status",
                             body={**fresh, "status": {**fresh.get("status", {}),
                                                       "preemptions": 7}})

        assert reconcile_once(cluster.kube, cluster.ns, "polled",
                              Options(cache=cache, poll_progress=True)) == "success"
    finally:
        trainer.close()
    assert trainer.polls == 1, "the round that read the job fresh polled the trainer again"
    assert trainer.paths == ["/progress"]  # restart mode: the plain path, as older trainers know
    status = cluster.status("polled")
    assert status.get("preemptions") == 7
    health = status["progress"]["checkpointHealth"]
    assert health["consecutiveFailures"] == 1 and "SignatureDoesNotMatch" in health["lastError"]
