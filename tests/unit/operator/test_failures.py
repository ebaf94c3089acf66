"""classify_pod_exit: preemption vs failure vs success, for every signal Kubernetes gives."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from elastrain_operator.model.names import WORKER_FINALIZER
from elastrain_operator.policy.failures import (
    Exit,
    classify_pod_exit,
    describe_exit,
    read_worker_pod,
)

DISRUPTION_REASONS = ["PreemptionByScheduler", "DeletionByTaintManager", "EvictionByEvictionAPI",
                      "DeletionByPodGC", "TerminationByKubelet"]


def make_pod(*, phase: str = "Running", exit_code: int | None = None, exit_reason: str = "",
             disruption: str | None = None, deleting: bool = False, reason: str = "",
             index: int = 0, attempt: int = 0, message: str = "") -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "conditions": []}
    if disruption:
        status["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                     "reason": disruption})
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {
            "exitCode": exit_code, "reason": exit_reason, "message": message}}}]
    if reason:
        status["reason"] = reason
    meta: dict[str, Any] = {"name": f"j-worker-{index}-{attempt}", "finalizers": [WORKER_FINALIZER],
                            "labels": {"elastrain.dev/worker-index": str(index),
                                       "elastrain.dev/attempt": str(attempt)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": status}


def classify(**kw: Any) -> Exit:
    pod = read_worker_pod(make_pod(**kw), WORKER_FINALIZER)
    assert pod is not None
    return classify_pod_exit(pod)


@pytest.mark.parametrize("reason", DISRUPTION_REASONS)
def test_every_disruption_target_reason_is_preemption(reason: str) -> None:
    assert classify(phase="Failed", exit_code=143, disruption=reason) is Exit.PREEMPTED
    assert classify(phase="Running", disruption=reason) is Exit.PREEMPTED


def test_sigterm_checkpoint_that_exits_zero_is_still_preemption() -> None:
    assert classify(phase="Succeeded", exit_code=0,
                    disruption="TerminationByKubelet") is Exit.PREEMPTED


def test_exit_143_after_sigterm_with_disruption_is_preemption() -> None:
    assert classify(phase="Failed", exit_code=143, disruption="PreemptionByScheduler") \
        is Exit.PREEMPTED


def test_eviction_and_node_loss_reasons_are_preemption() -> None:
    assert classify(phase="Failed", reason="Evicted") is Exit.PREEMPTED
    assert classify(phase="Failed", reason="NodeLost") is Exit.PREEMPTED
    assert classify(phase="Failed", reason="Terminated") is Exit.PREEMPTED


def test_deletion_by_someone_else_is_preemption() -> None:
    assert classify(phase="Running", deleting=True) is Exit.PREEMPTED


def test_own_failures() -> None:
    assert classify(phase="Failed", exit_code=1, exit_reason="Error") is Exit.FAILED
    assert classify(phase="Failed", exit_code=137, exit_reason="OOMKilled") is Exit.FAILED
    assert classify(phase="Failed", exit_code=143) is Exit.FAILED  # SIGTERM without disruption


# The tail of a real agent's log after its job's store pod was deleted (e2e, a real node).
STORE_LOST_LOG = """    raise RendezvousConnectionError(
torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d \
store has failed. See inner exception for details."""


def test_agent_that_lost_the_rendezvous_store_is_preempted_not_failed() -> None:
    assert classify(phase="Failed", exit_code=1, exit_reason="Error",
                    message=STORE_LOST_LOG) is Exit.PREEMPTED
    pod = read_worker_pod(make_pod(phase="Failed", exit_code=1, message=STORE_LOST_LOG),
                          WORKER_FINALIZER)
    assert pod is not None and "rendezvous store lost" in describe_exit(pod)
    # Any other traceback is the job's own failure.
    assert classify(phase="Failed", exit_code=1, exit_reason="Error",
                    message="ValueError: boom") is Exit.FAILED


def test_success_running_pending() -> None:
    assert classify(phase="Succeeded", exit_code=0) is Exit.SUCCEEDED
    assert classify(phase="Running") is Exit.RUNNING
    assert classify(phase="Pending") is Exit.PENDING


def test_disruption_condition_false_is_ignored() -> None:
    raw = make_pod(phase="Failed", exit_code=1)
    raw["status"]["conditions"].append({"type": "DisruptionTarget", "status": "False",
                                        "reason": "PreemptionByScheduler"})
    pod = read_worker_pod(raw, WORKER_FINALIZER)
    assert pod is not None and classify_pod_exit(pod) is Exit.FAILED


def test_pod_without_slot_labels_is_not_read() -> None:
    raw = make_pod()
    del raw["metadata"]["labels"]["elastrain.dev/attempt"]
    assert read_worker_pod(raw, WORKER_FINALIZER) is None


def test_read_worker_pod_fields() -> None:
    raw = make_pod(phase="Pending", index=2, attempt=5)
    raw["status"]["conditions"].append({"type": "PodScheduled", "status": "False",
                                        "reason": "Unschedulable", "message": "0/1 nodes"})
    pod = read_worker_pod(raw, WORKER_FINALIZER)
    assert pod is not None
    assert (pod.index, pod.attempt, pod.has_finalizer) == (2, 5, True)
    assert pod.unschedulable == "0/1 nodes"


def test_a_crash_reason_from_the_launcher_is_quoted_and_kept_short() -> None:
    crash = ("elastrain: worker crashed: rank 3, exit code 1: AssertionError: loss is nan "
             + "x" * 300)
    pod = read_worker_pod(make_pod(phase="Failed", exit_code=1, exit_reason="Error",
                                   message=f"Traceback...\n{crash}\n"), WORKER_FINALIZER)
    assert pod is not None and classify_pod_exit(pod) is Exit.FAILED
    why = describe_exit(pod)
    assert why.startswith("exit code 1, Error, rank 3, exit code 1: AssertionError: loss is nan")
    assert len(why) <= 256 and why.endswith("...")  # fits status.recentLosses[].reason
    plain = read_worker_pod(make_pod(phase="Failed", exit_code=1, exit_reason="Error",
                                     message="Traceback...\nKeyError: 'x'"), WORKER_FINALIZER)
    assert plain is not None and describe_exit(plain) == "exit code 1, Error"


def test_a_lost_pod_is_dated_by_its_earliest_sign() -> None:
    pod = make_pod(phase="Failed", exit_code=143, disruption="EvictionByEvictionAPI",
                   deleting=True)
    pod["status"]["conditions"][0]["lastTransitionTime"] = "2026-01-01T00:00:05Z"
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = \
        "2026-01-01T00:00:09Z"
    # deletionTimestamp is the request plus the grace period: asked at 23:59:30.
    pod["metadata"]["deletionGracePeriodSeconds"] = 30
    parsed = read_worker_pod(pod, WORKER_FINALIZER)
    assert parsed is not None and parsed.lost_at == datetime(2025, 12, 31, 23, 59, 30, tzinfo=UTC)
    del pod["metadata"]["deletionTimestamp"]
    parsed = read_worker_pod(pod, WORKER_FINALIZER)
    assert parsed is not None and parsed.lost_at == datetime(2026, 1, 1, 0, 0, 5, tzinfo=UTC)
    pod["status"]["conditions"] = []
    parsed = read_worker_pod(pod, WORKER_FINALIZER)
    assert parsed is not None and parsed.lost_at == datetime(2026, 1, 1, 0, 0, 9, tzinfo=UTC)
    running = read_worker_pod(make_pod(), WORKER_FINALIZER)
    assert running is not None and running.lost_at is None
