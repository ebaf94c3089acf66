"""Notices acted on first (issue 34 item 5; docs/recovery.md section 10, "Notices").

A node often says it is about to go before any SIGTERM: a cordon (a drain's first step),
Karpenter's `karpenter.sh/disrupted:NoSchedule` (v0.32-0.37: `karpenter.sh/disruption`), or
aws-node-termination-handler's opt-in `.../spot-itn` and `.../rebalance-recommendation` taints
(shared/notes/kueue-and-notices.md says which are verified; GKE gives none before its SIGTERM,
and its taint names are read only from the chart's list). `node_notice` reads one.

An in-process job moves a worker off such a node replacement first, so its world never drops
below its size for a notice it was given:
1. the worker's slot gets a new attempt at once, not counted as a loss, remembering the old pod
   (WorkerSlot.moving_from); the new pod lands elsewhere because the signal itself keeps the
   scheduler away (a cordon, a NoSchedule taint: every signal read by default is one; a
   listed taint of a weaker effect moves nothing useful) and arrives as a spare (the world is
   full). No node affinity is added: it would outlive the notice, and a pod made during a
   drain on a one-node cluster stayed Pending after the uncordon (e2e scenario 7, seen);
2. the old pod trains on until the new one is in the world's plan (the members' /progress
   `members`/`spares`), then it is deleted: its SIGTERM is a leave at the next step boundary,
   where the spare takes its place, healed from a live peer. Where a spare already waits
   (spec.spares, on a node without notice, named a spare by every member), the old pod is
   deleted at once and that spare takes its place; the new pod becomes the spare when it
   joins. A spare serves one move: the old pods already asked to leave but still in the world
   use up as many;
3. a replacement that cannot be scheduled moves nothing (the old pod trains on); a notice
   withdrawn before the replacement joined undoes the move (the slot goes back to the old
   pod's attempt, the new pod goes: the job is exactly its spec size again); an old pod taken
   before its replacement joined (a drain quicker than the move) is counted once as any lost
   worker (policy.planning): the world did shrink.
A Restart-mode job moves a worker "a save, then the move": its replacement is created first
as above; once the scheduler has bound it to another node, the old pod is deleted, and its
SIGTERM makes every worker save the step and restart (torchrun's rendezvous), the replacement
among them. Not counted, 0 steps lost, and done at a step boundary of the operator's choosing,
not at the eviction's deadline; the same rules for an unschedulable replacement, a withdrawal
and a drain quicker than the move.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from elastrain_operator.model import conditions as c
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import TrainingJobStatus, WorkerSlot
from elastrain_operator.policy.failures import Exit, WorkerPod, classify_pod_exit
from elastrain_operator.policy.progress import ProgressReport
from elastrain_operator.policy.round import Observed, Round, current_pods
from elastrain_operator.policy.status import (
    EventSpec,
    find_condition,
    make_condition,
    set_condition,
)

# Read by default: the taints verified in the projects' sources (the note above). The chart's
# `notices.taints` replaces the list.
DEFAULT_NOTICE_TAINTS = (
    "karpenter.sh/disrupted",
    "karpenter.sh/disruption",
    "aws-node-termination-handler/spot-itn",
    "aws-node-termination-handler/rebalance-recommendation",
)
CORDONED = "cordoned"


def node_notice(node: Mapping[str, Any], taints: Collection[str]) -> str | None:
    """What a Node says about its going, or None: the first listed taint it carries (its key,
    and its value where it has one), else a cordon."""
    spec = node.get("spec") or {}
    for taint in spec.get("taints") or ():
        key = taint.get("key")
        if key in taints:
            value = taint.get("value")
            return f"taint {key}={value}" if value else f"taint {key}"
    return CORDONED if spec.get("unschedulable") else None


def move_noticed(r: Round, job: TrainingJob, observed: Observed,
                 reports: Sequence[ProgressReport] | None, *, pods: int) -> None:
    """Start, advance or undo the moves of a job's workers (the module says how);
    `reports`: the members' (a spare's plan is not the world's)."""
    by_name = {p.name: p for p in observed.workers}
    current = current_pods(r.acct.slots, observed.workers)
    if job.spec.in_process:
        ready = frozenset().union(*(rep.world_pods for rep in reports or ()))
    else:  # bound to a node: its agent will be at the rendezvous the old pod's leave opens
        ready = frozenset(p.name for p in observed.workers if p.node and not p.deleting
                          and classify_pod_exit(p) in (Exit.RUNNING, Exit.PENDING))
    spares = _waiting_spares(job, r.acct.slots, by_name, reports, observed.notices)
    slots = []
    for slot in r.acct.slots:
        if slot.index < pods:
            slot = (_advance(r, job, slot, by_name.get(slot.moving_from),
                             current.get(slot.index), ready, observed.notices, spares)
                    if slot.moving_from else _start(r, job, slot, current.get(slot.index),
                                                    observed))
        slots.append(slot)
    r.acct = replace(r.acct, slots=tuple(slots))


def _waiting_spares(job: TrainingJob, slots: Sequence[WorkerSlot],
                    by_name: Mapping[str, WorkerPod], reports: Sequence[ProgressReport] | None,
                    notices: Mapping[str, str]) -> list[str]:
    """The spares free to take a moving worker's place now: named a spare by every member, on
    a node without notice, less one for each old pod already asked to leave (a spare takes its
    place at its leave)."""
    if not job.spec.in_process or not reports:
        return []
    named = sorted(frozenset.intersection(*(rep.spare_pods for rep in reports)))
    free = [p for p in named if p in by_name and not by_name[p].deleting
            and by_name[p].node not in notices]
    world = frozenset().union(*(rep.world_pods for rep in reports))
    leaving = [s for s in slots if s.moving_from is not None and s.moving_from in world
               and s.moving_from in by_name and by_name[s.moving_from].deleting]
    return free[len(leaving):]


def _start(r: Round, job: TrainingJob, slot: WorkerSlot, pod: WorkerPod | None,
           observed: Observed) -> WorkerSlot:
    if pod is None or pod.deleting or classify_pod_exit(pod) is not Exit.RUNNING:
        return slot
    signal = observed.notices.get(pod.node)
    if signal is None:
        return slot
    then = ("joins first, then it leaves at a step boundary" if job.spec.in_process else
            "is scheduled first, then it stops with a save at a step boundary (every worker "
            "restarts from it)")
    r.events.append(EventSpec(
        "Normal", c.NODE_DISRUPTION_NOTICE,
        f"node {pod.node}: {signal}; worker {slot.index} (pod {pod.name}) moves: its "
        f"replacement starts on another node and {then} (not counted)"))
    return slot.model_copy(update={"attempt": slot.attempt + 1, "moving_from": pod.name,
                                   "replace_after": None})


def _advance(r: Round, job: TrainingJob, slot: WorkerSlot, old: WorkerPod | None,
             new: WorkerPod | None, ready: frozenset[str],
             notices: Mapping[str, str], spares: list[str]) -> WorkerSlot:
    """`spares`: the waiting spares free to take a place (_waiting_spares); one used here is
    taken off it."""
    if old is None or classify_pod_exit(old) not in (Exit.RUNNING, Exit.PENDING):
        return slot.model_copy(update={"moving_from": None})  # gone: cleaned up as stale
    if old.deleting:
        return slot  # asked to leave (or drained): the move ends when it is gone
    if new is not None and new.name in ready:
        r.delete_pods.append(old.name)
        now = ("joined the world" if job.spec.in_process else "is scheduled")
        then = ("leaves at a step boundary" if job.spec.in_process
                else "stops with a save at a step boundary")
        r.events.append(EventSpec(
            "Normal", c.NODE_DISRUPTION_NOTICE,
            f"worker {slot.index}: pod {new.name} {now} on node {new.node or '?'}; pod "
            f"{old.name} on node {old.node} now {then}"))
        return slot
    if spares and old.node in notices:
        spare = spares.pop(0)
        r.delete_pods.append(old.name)
        r.events.append(EventSpec(
            "Normal", c.NODE_DISRUPTION_NOTICE,
            f"worker {slot.index}: spare pod {spare} takes the place of pod {old.name} on node "
            f"{old.node}, which now leaves at a step boundary; pod "
            f"{new.name if new is not None else '?'} becomes a spare once it joins"))
        return slot
    if old.node not in notices:
        # Withdrawn before the replacement joined: back to the old pod; the new one is stale
        # now and goes (planning ignores a deleting pod's newer attempt).
        r.events.append(EventSpec(
            "Normal", c.NODE_DISRUPTION_NOTICE,
            f"node {old.node}: the notice was withdrawn before worker {slot.index}'s "
            f"replacement joined: pod {old.name} stays"
            + (f", pod {new.name} goes" if new is not None else "")))
        return slot.model_copy(update={"attempt": old.attempt, "moving_from": None,
                                       "replace_after": None})
    return slot


def notice_condition(status: TrainingJobStatus, slots: Sequence[WorkerSlot], observed: Observed,
                     *, now: datetime, generation: int) -> TrainingJobStatus:
    """NodeDisruptionNotice: True while a worker moves (the nodes and their signals), False
    once none does; absent on a job that never had one. False (NoticesOff) on an in-process
    job while the operator was asked to read notices and may not."""
    moving = [s for s in slots if s.moving_from]
    was = find_condition(status.conditions, c.NODE_DISRUPTION_NOTICE)
    if observed.notices_off and not moving:
        cond = make_condition(c.NODE_DISRUPTION_NOTICE, False, c.NOTICES_OFF,
                              f"node notices are not read: {observed.notices_off}", now=now,
                              generation=generation)
    elif moving:
        by_pod = {p.name: p.node for p in observed.workers}
        nodes = sorted({by_pod.get(s.moving_from or "", "") for s in moving} - {""})
        said = "; ".join(f"{n}: {observed.notices.get(n, 'notice withdrawn')}" for n in nodes)
        cond = make_condition(
            c.NODE_DISRUPTION_NOTICE, True, c.MOVING_WORKERS,
            f"moving worker(s) {', '.join(str(s.index) for s in moving)} off node(s) "
            f"{said or '?'}: each replacement joins first", now=now, generation=generation)
    elif was is not None and was.status == "True":
        cond = make_condition(c.NODE_DISRUPTION_NOTICE, False, c.NO_MOVE,
                              "no worker is moving", now=now, generation=generation)
    else:
        return status
    return status.model_copy(update={"conditions": set_condition(status.conditions, cond)})
