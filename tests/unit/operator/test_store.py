"""policy.store: the store pod's readiness in Kubernetes' own terms, the store attempt, which
worker losses are the store's, their backoff, and the readiness bound."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from elastrain_operator.model import conditions as c
from elastrain_operator.model.spec import RendezvousStore, RestartPolicy
from elastrain_operator.model.status import RendezvousStoreState
from elastrain_operator.policy.failures import WorkerPod
from elastrain_operator.policy.store import (
    StorePod,
    count_store_loss,
    derive_store_readiness,
    is_lost_to_store,
    read_store_pod,
    store_hold,
    store_timed_out,
    track_store,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STORE_LOST = ("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The "
              "connection to the C10d store has failed. See inner exception for details.")


def store_pod(*, phase: str = "Pending", ready: bool = False, conditions: Any = (),
              container: dict[str, Any] | None = None, **status: Any) -> dict[str, Any]:
    conds = [{"type": "Ready", "status": "True" if ready else "False"}, *conditions]
    return {"metadata": {"name": "demo-rdzv", "uid": "s1",
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": phase, "conditions": conds, **status,
                       "containerStatuses": [] if container is None else [
                           {"name": "rdzv-store", "restartCount": 0, **container}]}}


def readiness(pod: dict[str, Any]) -> tuple[bool, str, str]:
    r = derive_store_readiness(read_store_pod(pod))
    return r.ready, r.reason, r.message


def test_ready() -> None:
    assert readiness(store_pod(phase="Running", ready=True,
                               container={"state": {"running": {}}}))[:2] == (True, c.STORE_READY)


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff", "InvalidImageName"])
def test_an_image_pull_error_quotes_the_kubelet(reason: str) -> None:
    pod = store_pod(container={"state": {"waiting": {
        "reason": reason, "message": 'Back-off pulling image "store:nope"'}}})
    assert readiness(pod) == (False, c.STORE_IMAGE_PULL_FAILED,
                              f'{reason}: Back-off pulling image "store:nope"')


def test_a_crash_loop_quotes_the_last_log_line() -> None:
    log = ("Traceback (most recent call last):\n  ...\n"
           "ModuleNotFoundError: No module named 'torch'\n")
    pod = store_pod(phase="Running", container={
        "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff",
                                                 "message": "back-off 40s restarting"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": log}}})
    ready, reason, message = readiness(pod)
    assert (ready, reason) == (False, c.STORE_CRASH_LOOPING)
    assert message == ("restarted 3 time(s), exit code 1 (Error); last log line: "
                       "ModuleNotFoundError: No module named 'torch'")


def test_a_missing_command_is_a_crash_loop_with_the_runtimes_message() -> None:
    """An image without python3: the runtime cannot start it (StartError, exit 128)."""
    pod = store_pod(phase="Running", container={
        "restartCount": 1, "state": {"terminated": {
            "exitCode": 128, "reason": "StartError",
            "message": 'exec: "python3": executable file not found in $PATH'}}})
    ready, reason, message = readiness(pod)
    assert (ready, reason) == (False, c.STORE_CRASH_LOOPING)
    assert message.endswith('last log line: exec: "python3": executable file not found in $PATH')


def test_unschedulable_quotes_the_scheduler() -> None:
    why = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."
    pod = store_pod(conditions=[{"type": "PodScheduled", "status": "False",
                                 "reason": "Unschedulable", "message": why}])
    assert readiness(pod) == (False, c.STORE_UNSCHEDULABLE, f"no node takes the store pod: {why}")


def test_a_container_the_kubelet_cannot_create() -> None:
    pod = store_pod(container={"state": {"waiting": {
        "reason": "CreateContainerConfigError", "message": 'secret "x" not found'}}})
    assert readiness(pod) == (False, c.STORE_CONTAINER_FAILED,
                              'CreateContainerConfigError: secret "x" not found')


@pytest.mark.parametrize(("pod", "message"), [
    (None, "the store pod is being created"),
    (store_pod(), "the store pod is pending"),
    (store_pod(container={"state": {"waiting": {"reason": "ContainerCreating"}}}),
     "the store pod is waiting: ContainerCreating"),
    (store_pod(phase="Running", container={"state": {"running": {}}}),
     "the store pod is running, not accepting connections yet"),
])
def test_starting_is_no_failure(pod: dict[str, Any] | None, message: str) -> None:
    r = derive_store_readiness(None if pod is None else read_store_pod(pod))
    assert (r.ready, r.reason, r.message) == (False, c.STORE_STARTING, message)


def test_an_evicted_or_deleted_store_is_lost() -> None:
    evicted = store_pod(phase="Failed", reason="Evicted", message="low on memory")
    assert readiness(evicted) == (False, c.STORE_LOST, "the store pod ended (Failed): Evicted: "
                                  "low on memory; a new one replaces it")
    assert derive_store_readiness(StorePod(phase="Running", ready=True, deleting=True)).reason \
        == c.STORE_LOST


def test_the_attempt_follows_the_store_pod() -> None:
    pod = StorePod(uid="s1", created=T0)
    first = track_store(None, pod, now=T0 + timedelta(seconds=2))
    assert first == RendezvousStoreState(uid="s1", created=T0)
    assert track_store(first, None, now=T0 + timedelta(seconds=9)) == first  # gone: judged by it
    ready = track_store(first, StorePod(uid="s1", created=T0, ready=True),
                        now=T0 + timedelta(seconds=5))
    assert ready is not None and ready.ready_at == T0 + timedelta(seconds=5)
    # Not Ready again later: it was Ready once, so it stays that attempt's fact.
    assert track_store(ready, pod, now=T0 + timedelta(seconds=6)) == ready
    new = track_store(ready, StorePod(uid="s2", created=T0 + timedelta(seconds=7)),
                      now=T0 + timedelta(seconds=8))
    assert new == RendezvousStoreState(uid="s2", created=T0 + timedelta(seconds=7))
    # A pod stamped later than our clock is dated by our clock.
    assert track_store(None, StorePod(uid="s3", created=T0 + timedelta(seconds=60)),
                       now=T0).created == T0  # type: ignore[union-attr]


def worker(created: datetime, message: str = STORE_LOST) -> WorkerPod:
    return WorkerPod(name="demo-worker-0-0", index=0, attempt=0, phase="Failed", exit_code=1,
                     exit_message=message, created=created.isoformat())


def test_a_worker_is_lost_to_the_store_only_if_it_knew_no_ready_store() -> None:
    state = RendezvousStoreState(uid="s1", created=T0)
    assert is_lost_to_store(worker(T0), state)
    assert is_lost_to_store(worker(T0 + timedelta(seconds=30)), state)
    # Created before this store: it knew an earlier one, whose loss is the platform's.
    assert not is_lost_to_store(worker(T0 - timedelta(seconds=1)), state)
    # This store was Ready once: losing it is a preemption, as before.
    assert not is_lost_to_store(worker(T0), state.model_copy(update={"ready_at": T0}))
    # Another exit is judged as before (a crash is a failure).
    assert not is_lost_to_store(worker(T0, message="elastrain: worker crashed: rank 0"), state)
    assert not is_lost_to_store(worker(T0), None)


def test_store_losses_back_off_and_a_ready_store_ends_the_wait() -> None:
    policy = RestartPolicy(backoff_seconds=10, max_backoff_seconds=30)
    state = RendezvousStoreState(uid="s1", created=T0)
    assert store_hold(state, now=T0) is None
    delays = []
    for _ in range(4):
        state = count_store_loss(state, policy, T0)
        assert state.replace_after is not None
        delays.append((state.replace_after - T0).total_seconds())
    assert delays == [10, 20, 30, 30] and state.workers_lost == 4
    assert store_hold(state, now=T0 + timedelta(seconds=29)) == state.replace_after
    assert store_hold(state, now=T0 + timedelta(seconds=30)) is None
    ready = track_store(state, StorePod(uid="s1", created=T0, ready=True), now=T0)
    assert ready is not None and store_hold(ready, now=T0) is None


def test_a_store_never_ready_within_the_bound_fails_the_job() -> None:
    spec = RendezvousStore(ready_timeout_seconds=60)
    state = RendezvousStoreState(uid="s1", created=T0)
    pulling = derive_store_readiness(StorePod(uid="s1", waiting_reason="ImagePullBackOff",
                                              waiting_message="no such image"))
    assert store_timed_out(spec, state, pulling, "demo-rdzv",
                           now=T0 + timedelta(seconds=59)) is None
    reason, message = store_timed_out(spec, state, pulling, "demo-rdzv",
                                      now=T0 + timedelta(seconds=60)) or ("", "")
    assert reason == c.RENDEZVOUS_STORE_NOT_READY
    assert message == ("the rendezvous store pod demo-rdzv was not Ready within "
                       "spec.rendezvous.store.readyTimeoutSeconds (60); StoreImagePullFailed: "
                       "ImagePullBackOff: no such image")
    later = T0 + timedelta(hours=1)
    ready_once = state.model_copy(update={"ready_at": T0})
    assert store_timed_out(spec, ready_once, pulling, "demo-rdzv", now=later) is None
    assert store_timed_out(RendezvousStore(ready_timeout_seconds=0), state, pulling, "demo-rdzv",
                           now=later) is None
    assert RendezvousStore().ready_timeout_seconds == 600
