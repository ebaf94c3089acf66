"""Counting each lost worker exactly once: a slot's attempt rises with every loss it counts
(policy.planning's first step). A preemption and a failure are counted as such (a failure
against the restart budget, with its backoff), a configuration error not at all (the job
fails), a worker lost to a store that was never Ready as the store's loss (policy.store), and
a move's old pod taken before its replacement joined as any lost worker (policy.notices).
Slots a scale-down or a suspend no longer wants are retired: their pods are cleaned up, never
counted."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from elastrain_operator.model import conditions as c
from elastrain_operator.model.names import store_name
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import WorkerLoss, WorkerSlot
from elastrain_operator.policy.failures import (
    DISRUPTION_REASONS,
    Exit,
    WorkerPod,
    classify_pod_exit,
    configuration_error,
    describe_exit,
    evicted_from_lost_node,
)
from elastrain_operator.policy.restarts import backoff_until
from elastrain_operator.policy.round import MAX_RECENT_LOSSES, Observed, Round
from elastrain_operator.policy.status import EventSpec
from elastrain_operator.policy.store import count_store_loss, is_lost_to_store


def _by_slot(workers: Sequence[WorkerPod]) -> dict[int, list[WorkerPod]]:
    grouped: dict[int, list[WorkerPod]] = defaultdict(list)
    for pod in workers:
        grouped[pod.index].append(pod)
    return grouped


def _count_loss(r: Round, job: TrainingJob, pod: WorkerPod, exit_: Exit,
                slot: WorkerSlot, now: datetime, lost_node: str | None = None) -> WorkerSlot:
    """`lost_node`: why the pod's node is lost, when its taint manager evicted the pod from it
    (failures.evicted_from_lost_node): a failure, not a preemption."""
    preempted = exit_ is Exit.PREEMPTED and lost_node is None
    why = describe_exit(pod)
    if lost_node is not None:
        why = f"node {pod.node} lost ({lost_node}): {why}"
    # Dated by the pod (never later than now: clocks of kubelet and operator may differ).
    lost_at = min(pod.lost_at, now) if pod.lost_at is not None else now
    loss = WorkerLoss(index=pod.index, pod=pod.name, kind="Preempted" if preempted else "Failed",
                      reason=why, exit_code=pod.exit_code, time=lost_at)
    acct = r.acct
    if preempted:
        r.counted_preemptions += 1
        acct = replace(acct, preemptions=acct.preemptions + 1, last_loss_reason=c.WORKER_PREEMPTED)
        r.events.append(EventSpec("Warning", c.WORKER_PREEMPTED,
                                  f"worker {pod.index} (pod {pod.name}) preempted: {why}"))
        after = None
    elif config := configuration_error(pod):
        # No restart could fix it: not counted, no backoff; _decide_terminal fails the job.
        after = None
        r.config_error = r.config_error or f"worker {pod.index} (pod {pod.name}): {config}"
        r.events.append(EventSpec("Warning", c.CONFIGURATION_ERROR,
                                  f"worker {pod.index} (pod {pod.name}) failed: {why}"))
        # Recorded among the losses, but nothing is being replaced (not Restarting).
        r.acct = replace(acct, losses=(*acct.losses, loss)[-MAX_RECENT_LOSSES:])
        return slot.model_copy(update={"attempt": slot.attempt + 1, "replace_after": None})
    else:
        r.counted_restarts += 1
        restarts = acct.restarts + 1
        after = backoff_until(job.spec.restart_policy, restarts, now)
        acct = replace(acct, restarts=restarts, last_loss_reason=c.WORKER_FAILED,
                       backoff_until=after or acct.backoff_until)
        r.events.append(EventSpec("Warning", c.WORKER_FAILED,
                                  f"worker {pod.index} (pod {pod.name}) failed: {why}"))
    r.acct = replace(acct, losses=(*acct.losses, loss)[-MAX_RECENT_LOSSES:],
                     recovering_since=min(acct.recovering_since or lost_at, lost_at))
    # A move under way goes on: the old pod still trains (policy.notices).
    return slot.model_copy(update={"attempt": slot.attempt + 1, "replace_after": after})


def _count_store_loss(r: Round, job: TrainingJob, pod: WorkerPod, slot: WorkerSlot,
                      now: datetime) -> WorkerSlot:
    """A worker lost to a store never Ready: not counted; replaced after the store's backoff."""
    assert r.acct.store is not None
    store = count_store_loss(r.acct.store, job.spec.restart_policy, now)
    r.acct = replace(r.acct, store=store)
    after = (f"after {store.replace_after.isoformat()} or " if store.replace_after else "")
    r.events.append(EventSpec(
        "Warning", c.WAITING_FOR_STORE,
        f"worker {pod.index} (pod {pod.name}) lost the rendezvous store "
        f"{store_name(job.metadata.name)}, which has not been Ready since "
        f"{store.created.isoformat()}: not counted as a preemption; replaced {after}"
        "once the store is Ready"))
    return slot.model_copy(update={"attempt": slot.attempt + 1, "replace_after": None})


def account(r: Round, job: TrainingJob, observed: Observed, *, pods: int,
             counting: bool, now: datetime) -> None:
    """Raise the attempt of every slot whose current pod is lost (counting it) or retired."""
    slots = {s.index: s for s in r.acct.slots}
    grouped = _by_slot(observed.workers)
    for index in sorted(set(slots) | set(grouped)):
        slot = slots.get(index) or WorkerSlot(index=index)
        # A pod on its way out is no evidence: a move undone (policy.notices) deletes the
        # newer attempt's pod and goes back to the older one.
        newest = max((p.attempt for p in grouped.get(index, []) if not p.deleting), default=-1)
        if newest > slot.attempt:  # the status lost a write someone made; trust the pods
            slot = slot.model_copy(update={"attempt": newest, "replace_after": None})
        current = next((p for p in grouped.get(index, []) if p.attempt == slot.attempt), None)
        if current is not None and index >= pods:
            slot = WorkerSlot(index=index, attempt=slot.attempt + 1)  # retired: no move either
        elif current is not None and counting:
            exit_ = classify_pod_exit(current)
            if exit_ is Exit.PREEMPTED and is_lost_to_store(current, r.acct.store):
                slot = _count_store_loss(r, job, current, slot, now)
            elif exit_ in (Exit.PREEMPTED, Exit.FAILED):
                slot = _count_loss(r, job, current, exit_, slot, now,
                                   evicted_from_lost_node(current, observed.lost_nodes))
        if slot.moving_from and counting and index < pods:
            slot = _count_moving_loss(r, job, grouped.get(index, []), slot, now)
        slots[index] = slot
    r.acct = replace(r.acct, slots=tuple(slots[i] for i in sorted(slots)))


def _count_moving_loss(r: Round, job: TrainingJob, pods: Sequence[WorkerPod], slot: WorkerSlot,
                       now: datetime) -> WorkerSlot:
    """A move's old pod (policy.notices) taken before its replacement joined: evicted by a
    drain, its node's taint manager, or failed on its own. Counted once, as any lost worker
    (the world did shrink); its replacement already exists, so the slot keeps its attempt and
    the move ends. A pod this operator asked to leave ends without a disruption: not a loss."""
    old = next((p for p in pods if p.name == slot.moving_from), None)
    if old is None:
        return slot
    taken = (old.disruption_reason or old.status_reason in DISRUPTION_REASONS
             or (old.phase == "Failed" and not old.deleting))
    if not taken:
        return slot
    exit_ = Exit.FAILED if old.phase == "Failed" and not old.disruption_reason \
        else Exit.PREEMPTED
    after = _count_loss(r, job, old, exit_, slot, now)
    return slot.model_copy(update={"moving_from": None, "replace_after": after.replace_after})
