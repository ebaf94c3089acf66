"""The rendezvous store's readiness, and what a store that never works does to the job.

Every torchrun agent needs the job's store pod (render.rendezvous). When that pod never becomes
Ready (its image cannot be pulled, its container cannot start or crash-loops, no node takes it),
every agent gives up with RendezvousConnectionError, which would otherwise count as a preemption
and be replaced at once, forever. So, from the observed store pod alone:

- derive_store_readiness: the RendezvousStoreReady condition, with the reason and message the
  pod gives in Kubernetes' own terms (a container's waiting reason and message, the last line of
  a crashed container's log, the scheduler's Unschedulable message);
- track_store: the store "attempt" (status.rendezvousStore): which store pod, since when, and
  whether it has ever been Ready;
- is_lost_to_store: a worker that lost the rendezvous and was created while the current store
  was already there and has never been Ready is the store's loss: not a preemption, not a
  failure. Its replacement waits for backoff (restartPolicy's, doubling per such loss) unless the
  store turns Ready first. A worker created before the current store knew an earlier store, and
  one that lost a store that had been Ready lost it to the platform: preemptions, as before;
- store_timed_out: a store never Ready for spec.rendezvous.store.readyTimeoutSeconds fails the
  job (RendezvousStoreNotReady), naming the store pod and why it is not Ready;
- unheard_for: a store that was Ready but that no in-process trainer has heard for
  UNHEARD_TIMEOUTS heartbeat timeouts (each reports `storeUnansweredSeconds`) is replaced at once
  (policy.converge). Its node may be dark (packets dropped, the host hung) and still read Ready
  for the node controller's grace (~40-50 s), or its process frozen: a store that answers
  nothing closes nothing, so nothing else would replace it before its node is marked lost. In
  process a world trains on through that (docs/recovery.md section 7), but a worker dark with
  it (the same node) cannot be planned out without a store, so the whole world waited.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from elastrain_operator.model import conditions as c
from elastrain_operator.model.spec import RendezvousStore, RestartPolicy
from elastrain_operator.model.status import RendezvousStoreState
from elastrain_operator.policy.failures import WorkerPod, aware_time, lost_rendezvous
from elastrain_operator.policy.progress import ProgressReport
from elastrain_operator.policy.restarts import backoff_until

Manifest = dict[str, Any]

# Waiting reasons of a container whose image the kubelet cannot get (kubelet images package).
IMAGE_PULL_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
    "RegistryUnavailable", "ImageInspectError", "SignatureValidationFailed",
})
# Waiting reasons on the way to running: not a failure.
STARTING_REASONS = frozenset({"ContainerCreating", "PodInitializing", ""})
MESSAGE_LIMIT = 400
# A store unheard by every trainer for this many heartbeat timeouts is replaced: the trainers'
# own heartbeat gives up on a store request after as long (their store_lost).
UNHEARD_TIMEOUTS = 2


@dataclass(frozen=True)
class StorePod:
    """The slice of the store pod the planner reads."""

    phase: str = "Pending"
    deleting: bool = False
    uid: str = ""
    created: datetime | None = None
    ready: bool = False
    status_reason: str = ""  # pod.status.reason: Evicted, ...
    status_message: str = ""
    unschedulable: str = ""  # the scheduler's message while PodScheduled is False
    waiting_reason: str = ""
    waiting_message: str = ""
    restarts: int = 0
    last_exit_code: int | None = None
    last_exit_reason: str = ""
    last_log_line: str = ""  # of the last terminated run (its termination message: the log tail)
    node: str = ""  # spec.nodeName once bound


@dataclass(frozen=True)
class StoreReadiness:
    ready: bool
    reason: str
    message: str


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def read_store_pod(pod: Manifest) -> StorePod:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    conditions = {str(x.get("type")): x for x in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled") or {}
    container: Manifest = next(iter(status.get("containerStatuses") or []), {})
    state, last = container.get("state") or {}, container.get("lastState") or {}
    waiting = state.get("waiting") or {}
    terminated = state.get("terminated") or last.get("terminated") or {}
    return StorePod(
        phase=str(status.get("phase") or "Pending"),
        deleting=bool(meta.get("deletionTimestamp")),
        uid=str(meta.get("uid") or ""),
        created=aware_time(meta.get("creationTimestamp")),
        ready=(conditions.get("Ready") or {}).get("status") == "True",
        status_reason=str(status.get("reason") or ""),
        status_message=str(status.get("message") or ""),
        unschedulable=(str(scheduled.get("message") or scheduled.get("reason") or
                           "Unschedulable") if scheduled.get("status") == "False" else ""),
        waiting_reason=str(waiting.get("reason") or ""),
        waiting_message=str(waiting.get("message") or ""),
        restarts=int(container.get("restartCount") or 0),
        last_exit_code=terminated.get("exitCode"),
        last_exit_reason=str(terminated.get("reason") or ""),
        last_log_line=_last_line(str(terminated.get("message") or "")),
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
    )


def _cut(text: str) -> str:
    return text if len(text) <= MESSAGE_LIMIT else text[:MESSAGE_LIMIT - 3] + "..."


def _crash(store: StorePod) -> str:
    exit_ = f"exit code {store.last_exit_code}" if store.last_exit_code is not None else "exited"
    if store.last_exit_reason:
        exit_ += f" ({store.last_exit_reason})"
    tail = f"; last log line: {store.last_log_line}" if store.last_log_line else ""
    return f"restarted {store.restarts} time(s), {exit_}{tail}"


def derive_store_readiness(store: StorePod | None) -> StoreReadiness:
    """The RendezvousStoreReady condition's (status, reason, message) from the store pod."""
    if store is None:
        return StoreReadiness(False, c.STORE_STARTING, "the store pod is being created")
    if store.ready and not store.deleting:
        return StoreReadiness(True, c.STORE_READY, "the store pod is Ready")
    if store.deleting or store.phase in ("Failed", "Succeeded"):
        why = ": ".join(x for x in (store.status_reason, store.status_message) if x)
        return StoreReadiness(False, c.STORE_LOST, _cut(
            "the store pod " + ("is being deleted" if store.deleting else f"ended ({store.phase})")
            + (f": {why}" if why else "") + "; a new one replaces it"))
    if store.unschedulable:
        return StoreReadiness(False, c.STORE_UNSCHEDULABLE, _cut(
            f"no node takes the store pod: {store.unschedulable}"))
    waiting = f"{store.waiting_reason}: {store.waiting_message}".rstrip(": ")
    if store.waiting_reason in IMAGE_PULL_REASONS:
        return StoreReadiness(False, c.STORE_IMAGE_PULL_FAILED, _cut(waiting))
    if store.waiting_reason == "CrashLoopBackOff" or store.restarts:
        return StoreReadiness(False, c.STORE_CRASH_LOOPING, _cut(_crash(store)))
    if store.waiting_reason not in STARTING_REASONS:
        return StoreReadiness(False, c.STORE_CONTAINER_FAILED, _cut(waiting))
    doing = "running, not accepting connections yet" if store.phase == "Running" else (
        f"waiting: {store.waiting_reason}" if store.waiting_reason else "pending")
    return StoreReadiness(False, c.STORE_STARTING, f"the store pod is {doing}")


def track_store(state: RendezvousStoreState | None, store: StorePod | None, *,
                now: datetime) -> RendezvousStoreState | None:
    """The store attempt after observing `store`: a new pod (uid) starts a new attempt; a
    missing one keeps the last (its workers' losses are still judged against it)."""
    if store is None or not store.uid:
        return state
    ready = store.ready and not store.deleting
    if state is None or state.uid != store.uid:
        # Dated by the pod, never later than now (the apiserver's and our clocks may differ).
        created = min(store.created, now) if store.created is not None else now
        return RendezvousStoreState(uid=store.uid, created=created,
                                    ready_at=now if ready else None)
    if ready and state.ready_at is None:
        return state.model_copy(update={"ready_at": now, "replace_after": None})
    return state


def is_lost_to_store(pod: WorkerPod, state: RendezvousStoreState | None) -> bool:
    """The worker lost the rendezvous, and the only store it knew has never been Ready."""
    created = aware_time(pod.created)
    return (lost_rendezvous(pod) and state is not None and state.ready_at is None
            and created is not None and created >= state.created)


def count_store_loss(state: RendezvousStoreState, policy: RestartPolicy,
                     now: datetime) -> RendezvousStoreState:
    """One more worker lost to a never-Ready store; its replacement waits for the backoff."""
    lost = state.workers_lost + 1
    after = backoff_until(policy, lost, now)
    return state.model_copy(update={"workers_lost": lost, "replace_after": after})


def store_hold(state: RendezvousStoreState | None, *, now: datetime) -> datetime | None:
    """Until when missing workers wait for the store (None: create them now)."""
    if state is None or state.ready_at is not None or state.replace_after is None:
        return None
    return state.replace_after if now < state.replace_after else None


def store_timed_out(spec: RendezvousStore, state: RendezvousStoreState | None,
                    readiness: StoreReadiness, name: str, *,
                    now: datetime) -> tuple[str, str] | None:
    """(reason, message) failing the job when its store was never Ready in time, else None."""
    timeout = spec.ready_timeout_seconds
    if (not timeout or state is None or state.ready_at is not None or readiness.ready
            or now - state.created < timedelta(seconds=timeout)):
        return None
    return (c.RENDEZVOUS_STORE_NOT_READY,
            f"the rendezvous store pod {name} was not Ready within "
            f"spec.rendezvous.store.readyTimeoutSeconds ({timeout}); {readiness.reason}: "
            f"{readiness.message}")


def unheard_for(reports: Sequence[ProgressReport] | None, store: StorePod | None,
                state: RendezvousStoreState | None, heartbeat_timeout_s: float, *,
                now: datetime) -> float | None:
    """How long no trainer has heard the store, when that is reason to replace it now (None:
    keep it). Only on a poll with reports (none: the operator cannot tell a dark store from its
    own dark network), every one of them saying so, of a store that was Ready this long: the
    trainers still finding a store that just replaced another are not its silence."""
    if (not reports or store is None or not store.ready or store.deleting or state is None
            or state.uid != store.uid or state.ready_at is None):
        return None
    heard = [r.store_unanswered_s for r in reports]
    silent = [h for h in heard if h is not None]
    if len(silent) < len(heard):  # a trainer that does not say (an older image)
        return None
    unheard = min(*silent, (now - state.ready_at).total_seconds())
    return unheard if unheard >= UNHEARD_TIMEOUTS * heartbeat_timeout_s else None
