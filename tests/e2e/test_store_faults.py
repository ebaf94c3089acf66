"""A rendezvous store that never works, told on a real kubelet (issue 18, item 1).

The store pod's image does not exist: the kubelet reports ErrImagePull / ImagePullBackOff, the
workers' torchrun agents give up on the rendezvous (RendezvousConnectionError). The job says so
in RendezvousStoreReady (and `kubectl get tj`, `elastrain describe`), counts no preemption for
those workers, replaces them with backoff, and fails after readyTimeoutSeconds naming the store.
"""

from __future__ import annotations

from typing import Any

import pytest

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


@pytest.mark.parametrize("mode", list(RECOVERY_MODES.values()), ids=list(RECOVERY_MODES))
def test_a_store_image_that_does_not_exist_is_told_paced_and_fails_the_job(
        operator: NodeCluster, job_namespace: str, mode: str) -> None:
    """In InProcess mode the trainers' Session cannot reach the store either: each ends its pod
    with the same RendezvousConnectionError (EXIT_STORE_LOST), so the accounting is the same."""
    node, ns, k = operator, job_namespace, operator.kubectl
    timeout = 240
    job = make_job("nostore", ns, image=node.images["trainer"], s3_endpoint=node.s3.endpoint_url,
                   bucket=node.s3.bucket, replicas=2, **recovery_spec(mode))
    job["spec"]["rendezvous"] = {"store": {"image": MISSING_IMAGE,
                                           "readyTimeoutSeconds": timeout}}
    job["spec"]["restartPolicy"] = {"maxRestarts": 3, "backoffSeconds": 5}
    k.apply(job)

    cond = wait_for("RendezvousStoreReady=False StoreImagePullFailed", lambda: (
        c := _condition(job_status(k, ns, "nostore"), "RendezvousStoreReady"))
        .get("reason") == "StoreImagePullFailed" and c, timeout=120)
    assert cond["status"] == "False" and MISSING_IMAGE in cond["message"], cond
    row = k("get", "tj", "nostore", "-n", ns).stdout.splitlines()
    print("\n".join(row))
    assert "StoreImagePullFailed" in row[1].split(), row

    # The agents give up on the rendezvous: each such worker is the store's loss, not counted.
    status = wait_for("a worker lost to the store", lambda: (
        s := job_status(k, ns, "nostore")).get("rendezvousStore", {}).get("workersLost")
        and s, timeout=timeout - 30)
    assert status.get("preemptions", 0) == 0 and status.get("restarts", 0) == 0, status
    assert status["rendezvousStore"].get("replaceAfter"), status  # paced: backoff
    assert "WaitingForRendezvousStore" in event_reasons(k, ns, "nostore")
    pods = k.json("get", "pods", "-n", ns, "-l", "elastrain.dev/job-name=nostore")["items"]
    text = describe_job(k.json("get", "tj", "nostore", "-n", ns), pods)
    print(text)
    assert "not Ready, StoreImagePullFailed" in text and "lost to it, not counted" in text, text

    status = wait_for("the job Failed", lambda: (s := job_status(k, ns, "nostore"))
                      .get("phase") == "Failed" and s, timeout=timeout + 60)
    failed = _condition(status, "Failed")
    assert failed["reason"] == "RendezvousStoreNotReady", failed
    assert "rendezvous store pod nostore-rdzv" in failed["message"], failed
    assert "StoreImagePullFailed" in failed["message"], failed
    assert status.get("preemptions", 0) == 0 and status.get("restarts", 0) == 0, status
    # The operator posts events after the status write that the wait above saw: wait for it.
    wait_for("the RendezvousStoreNotReady event",
             lambda: "RendezvousStoreNotReady" in event_reasons(k, ns, "nostore"), timeout=60)
