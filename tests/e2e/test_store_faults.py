"""A rendezvous store that never works, told on a real kubelet (issue 18, item 1).

The store pod's image does not exist: the kubelet reports ErrImagePull / ImagePullBackOff, the
workers' torchrun agents give up on the rendezvous (RendezvousConnectionError). The job says so
in RendezvousStoreReady (and `kubectl get tj`, `elastrain describe`), counts no preemption for
those workers, replaces them with backoff, and fails after readyTimeoutSeconds naming the store.
"""

from __future__ import annotations

from typing import Any

from elastrain_operator.describe import describe_job
from tests.e2e.conftest import NodeCluster
from tests.e2e.support import (
    RECOVERY_MODES,
    event_reasons,
    job_status,
    make_job,
    recovery_spec,
    wait_for,
)

# No registry answers there: the pull fails at once, as for a mistyped image.
MISSING_IMAGE = "localhost:1/elastrain/no-such-store:0"


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def test_a_store_image_that_does_not_exist_is_told_paced_and_fails_the_job(
        operator: NodeCluster, job_namespace: str) -> None:
    """One job per recovery mode, side by side (the test is mostly waiting for the store's
    readyTimeoutSeconds, which both jobs spend together; 150 s leaves the workers' agents, which
    give up on an unreachable store after the TCPStore's 60 s connect timeout, time to be lost
    to it and replaced before the job fails). In InProcess mode the
    trainers' Session cannot reach the store either: each ends its pod with the same
    RendezvousConnectionError (EXIT_STORE_LOST), so the accounting is the same."""
    node, ns, k = operator, job_namespace, operator.kubectl
    timeout = 150
    names = {mode: f"nostore-{key}" for key, mode in RECOVERY_MODES.items()}
    for mode, name in names.items():
        job = make_job(name, ns, image=node.images["trainer"],
                       s3_endpoint=node.s3.endpoint_url, bucket=node.s3.bucket, replicas=2,
                       **recovery_spec(mode))
        job["spec"]["rendezvous"] = {"store": {"image": MISSING_IMAGE,
                                               "readyTimeoutSeconds": timeout}}
        job["spec"]["restartPolicy"] = {"maxRestarts": 3, "backoffSeconds": 5}
        k.apply(job)

    for name in names.values():
        cond = wait_for(
            f"{name}: RendezvousStoreReady=False StoreImagePullFailed", lambda name=name: (
                c := _condition(job_status(k, ns, name), "RendezvousStoreReady"))
            .get("reason") == "StoreImagePullFailed" and c, timeout=120)
        assert cond["status"] == "False" and MISSING_IMAGE in cond["message"], cond
        row = k("get", "tj", name, "-n", ns).stdout.splitlines()
        print("\n".join(row))
        assert "StoreImagePullFailed" in row[1].split(), row

    # The agents give up on the rendezvous: each such worker is the store's loss, not counted.
    for name in names.values():
        status = wait_for(f"{name}: a worker lost to the store", lambda name=name: (
            s := job_status(k, ns, name)).get("rendezvousStore", {})
            .get("workersLost") and s, timeout=timeout - 30)
        assert status.get("preemptions", 0) == 0 and status.get("restarts", 0) == 0, status
        assert status["rendezvousStore"].get("replaceAfter"), status  # paced: backoff
        assert "WaitingForRendezvousStore" in event_reasons(k, ns, name)
        pods = k.json("get", "pods", "-n", ns, "-l", f"elastrain.dev/job-name={name}")["items"]
        text = describe_job(k.json("get", "tj", name, "-n", ns), pods)
        print(text)
        assert "not Ready, StoreImagePullFailed" in text and "lost to it, not counted" in text, \
            text

    for name in names.values():
        status = wait_for(f"{name}: the job Failed", lambda name=name: (
            s := job_status(k, ns, name)).get("phase") == "Failed" and s,
            timeout=timeout + 60)
        failed = _condition(status, "Failed")
        assert failed["reason"] == "RendezvousStoreNotReady", failed
        assert f"rendezvous store pod {name}-rdzv" in failed["message"], failed
        assert "StoreImagePullFailed" in failed["message"], failed
        assert status.get("preemptions", 0) == 0 and status.get("restarts", 0) == 0, status
        # The operator posts events after the status write that the wait above saw: wait.
        wait_for(f"{name}: the RendezvousStoreNotReady event",
                 lambda name=name: "RendezvousStoreNotReady" in event_reasons(k, ns, name),
                 timeout=60)
