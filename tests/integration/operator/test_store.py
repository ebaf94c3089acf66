"""A rendezvous store that never works, against the real apiserver (issue 18, item 1): the store
pod's status is written as a kubelet would (an image it cannot pull, a crash loop), the workers
exit as torchrun agents do when the store never answers (RendezvousConnectionError)."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime

import pytest

from tests.integration.operator.conftest import Cluster, Operator, wait_for
from tests.integration.operator.test_lifecycle import running

pytestmark = pytest.mark.cluster

LOST = ("Traceback (most recent call last):\n"
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to "
        "the C10d store has failed. See inner exception for details.\n")
IMAGE = "registry.invalid/store:nope"
PULLING = {"phase": "Pending", "containerStatuses": [{
    "name": "rdzv-store", "image": IMAGE, "imageID": "", "ready": False, "restartCount": 0,
    "state": {"waiting": {"reason": "ImagePullBackOff",
                          "message": f'Back-off pulling image "{IMAGE}"'}}}]}
CRASHING = {"phase": "Running", "containerStatuses": [{
    "name": "rdzv-store", "image": "trainer:dev", "imageID": "", "ready": False,
    "restartCount": 4,
    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s"}},
    "lastState": {"terminated": {
        "exitCode": 1, "reason": "Error", "startedAt": "2026-01-01T00:00:00Z",
        "finishedAt": "2026-01-01T00:00:01Z",
        "message": "Traceback (most recent call last):\n  File \"<string>\", line 3\n"
                   "ModuleNotFoundError: No module named 'torch'\n"}}}]}
READY = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
         "containerStatuses": [{"name": "rdzv-store", "image": "trainer:dev", "imageID": "",
                                "ready": True, "restartCount": 4,
                                "state": {"running": {"startedAt": "2026-01-01T00:00:02Z"}}}]}


def store_reason(cluster: Cluster, reason: str) -> dict[str, str] | None:
    cond = cluster.condition("RendezvousStoreReady")
    return cond if cond.get("reason") == reason else None


def created(cluster: Cluster, pod: str) -> datetime:
    stamp = cluster.pods()[pod]["metadata"]["creationTimestamp"]
    return datetime.fromisoformat(stamp)


def test_a_store_never_ready_is_told_its_losses_paced_and_the_job_fails_naming_it(
        cluster: Cluster, operator: Operator) -> None:
    cluster.create_job(replicas=2, rendezvous={"store": {"readyTimeoutSeconds": 30}},
                       restartPolicy={"backoffSeconds": 3, "maxBackoffSeconds": 3})
    wait_for("store pod", lambda: cluster.pods(role="rdzv-store").get("demo-rdzv"))
    cluster.pod_status("demo-rdzv", PULLING)
    cond = wait_for("StoreImagePullFailed", lambda: store_reason(cluster, "StoreImagePullFailed"))
    assert cond["status"] == "False"
    assert cond["message"] == f'ImagePullBackOff: Back-off pulling image "{IMAGE}"'
    table = cluster.kubectl("get", "tj", "demo").stdout.splitlines()
    assert "STORE" in table[0].split() and "StoreImagePullFailed" in table[1].split(), table
    assert wait_for("StoreImagePullFailed event", lambda: cluster.events("StoreImagePullFailed"))

    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.exit("demo-worker-0-0", 1, message=LOST)
    cluster.exit("demo-worker-1-0", 1, message=LOST)
    status = wait_for("two workers lost to the store", lambda: (
        s := cluster.status()).get("rendezvousStore", {}).get("workersLost") == 2 and s)
    assert (status["preemptions"], status["restarts"]) == (0, 0), status
    assert "recentLosses" not in status or status["recentLosses"] == [], status
    told = wait_for("WaitingForRendezvousStore events", lambda: [
        e for e in cluster.events("WaitingForRendezvousStore")
        if "lost the rendezvous store demo-rdzv" in e["message"]])
    assert "not counted as a preemption" in told[0]["message"]
    after = datetime.fromisoformat(status["rendezvousStore"]["replaceAfter"])
    # Paced: the replacements come, and not before the store's backoff ended.
    cluster.wait_workers(["demo-worker-0-1", "demo-worker-1-1"])
    assert created(cluster, "demo-worker-0-1") >= after
    assert created(cluster, "demo-worker-1-1") >= after

    shown = subprocess.run(
        [sys.executable, "-m", "elastrain_cli", "describe", "demo", "-n", cluster.ns,
         "--kubeconfig", str(cluster.kube_fixture.kubeconfig)],
        capture_output=True, text=True, timeout=60)
    assert "not Ready, StoreImagePullFailed" in shown.stdout, shown.stdout + shown.stderr
    assert "(2 worker(s) lost to it, not counted)" in shown.stdout, shown.stdout

    wait_for("job failed", lambda: cluster.status().get("phase") == "Failed", timeout=60)
    failed = cluster.condition("Failed")
    assert failed["reason"] == "RendezvousStoreNotReady"
    assert failed["message"].startswith(
        "the rendezvous store pod demo-rdzv was not Ready within "
        "spec.rendezvous.store.readyTimeoutSeconds (30); StoreImagePullFailed: "), failed
    status = cluster.status()
    assert (status["preemptions"], status["restarts"]) == (0, 0), status
    assert wait_for("RendezvousStoreNotReady event",
                    lambda: cluster.events("RendezvousStoreNotReady"))
    wait_for("store deleted", lambda: not cluster.pods(role="rdzv-store"))


def test_a_store_that_becomes_ready_later_clears_and_training_proceeds(
        cluster: Cluster, operator: Operator) -> None:
    cluster.create_job(replicas=2, restartPolicy={"backoffSeconds": 300,
                                                  "maxBackoffSeconds": 300})
    wait_for("store pod", lambda: cluster.pods(role="rdzv-store").get("demo-rdzv"))
    cluster.pod_status("demo-rdzv", CRASHING)
    cond = wait_for("StoreCrashLooping", lambda: store_reason(cluster, "StoreCrashLooping"))
    assert cond["message"] == ("restarted 4 time(s), exit code 1 (Error); last log line: "
                               "ModuleNotFoundError: No module named 'torch'")
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.exit("demo-worker-1-0", 1, message=LOST)
    status = wait_for("a worker lost to the store", lambda: (
        s := cluster.status()).get("rendezvousStore", {}).get("workersLost") == 1 and s)
    assert status["preemptions"] == 0 and status.get("rendezvousStore", {}).get("replaceAfter")
    assert wait_for("waiting for the store", lambda: cluster.condition("AllWorkersRunning")
                    .get("reason") == "WaitingForRendezvousStore")

    cluster.pod_status("demo-rdzv", READY)
    cond = wait_for("StoreReady", lambda: store_reason(cluster, "StoreReady"))
    assert cond["status"] == "True"
    # The replacement does not wait out the 300 s backoff once the store is Ready.
    running(cluster, ["demo-worker-0-0", "demo-worker-1-1"])
    status = cluster.status()
    assert (status["preemptions"], status["restarts"]) == (0, 0), status
    assert status["rendezvousStore"]["readyAt"] and "replaceAfter" not in status[
        "rendezvousStore"], status
    assert wait_for("StoreReady event", lambda: cluster.events("StoreReady"))
