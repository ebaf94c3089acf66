"""Shrink to yield (issue 36 item 4): an elastic job gives Kueue back the quota of some of its
workers for a Workload of a higher priority that waits in the same ClusterQueue, or in another
ClusterQueue of its cohort, and that Kueue will not preempt anything for.

Kueue preempts within a ClusterQueue only when its `preemption.withinClusterQueue` allows it
(the default is Never), and it evicts a victim whole. So under the default a job of a lower
priority that runs above its minReplicas keeps the quota a more urgent Workload needs, and that
Workload waits until the job ends. Here the job frees the fewest workers that cover what the
waiting Workload lacks, as Kueue itself says it in the Workload's QuotaReserved message
("insufficient unused quota for cpu in flavor F, 300m more needed"), never below minReplicas and
at most once per YIELD_INTERVAL_S; its workers leave at a step boundary (in process: the others
train on, no stop, no step lost); once their pods are gone the Workload's
`status.reclaimablePods` says so, and Kueue admits the waiting Workload at once. Where Kueue
would preempt (withinClusterQueue LowerPriority or LowerOrNewerEqualPriority) it is left to
Kueue: the job is evicted whole and saves (policy.kueue).

In the cohort (`lends`): a Workload waiting in a sibling ClusterQueue gets the quota the job
frees by borrowing it. The job yields to it only where Kueue would not reclaim for it (the
sibling's `preemption.reclaimWithinCohort` Never, Kueue's default: with Any or LowerPriority
Kueue decides itself whom to evict, a borrowing job whole) and where the quota can reach it (the
job's ClusterQueue's lendingLimit and the sibling's borrowingLimit on that flavor, where set,
cover what it lacks); otherwise a yield would shrink the job for nothing.

Kueue lets reclaimablePods only grow while the quota is reserved, so the workers given back come
back through the job's extra Workload (policy.kueue_grow) or a slice (policy.kueue_slices),
admitted when quota frees, or with the job's next admission; neither is asked for while a more
urgent Workload of the cohort waits for the job's flavors (`outranked`). No yield while the extra
Workload's workers run (they hold the indices above the job's own admission and would have to
leave first).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

YIELD_INTERVAL_S = 60  # between two yields of one job: a queue that keeps changing moves it once
# Kueue's preemption policies within a ClusterQueue under which it preempts lower priorities.
PREEMPTS = ("LowerPriority", "LowerOrNewerEqualPriority")


@dataclass(frozen=True)
class Waiting:
    """A Workload of someone else's that Kueue tried and could not fit in the job's
    ClusterQueue (k8s.kueue_quota reads it)."""

    namespace: str
    name: str
    priority: int
    # What it lacks, from its QuotaReserved message: resource -> (flavor, amount).
    short: Mapping[str, tuple[str, Decimal]] = field(default_factory=dict)
    cohort: bool = False  # it waits in another ClusterQueue of the job's cohort (`lends`)


@dataclass(frozen=True)
class Yield:
    workers: int  # how many more workers to give back
    to: Waiting
    message: str


def decide_yield(*, priority: int, running: int, minimum: int, per_worker: Mapping[str, Decimal],
                 flavors: Mapping[str, str], waiting: Sequence[Waiting],
                 within_cluster_queue: str | None, last: datetime | None,
                 now: datetime) -> Yield | None:
    """The workers to give back now, if any: for the most urgent Waiting of a higher priority
    that the job's spare workers (running - minimum) can make fit. `flavors`: resource -> the
    flavor the job's workers were admitted on (quota freed elsewhere does not help);
    `within_cluster_queue`: the ClusterQueue's policy (None: Kueue's default, Never)."""
    if (within_cluster_queue or "Never") in PREEMPTS:
        # Kueue preempts for those of its own ClusterQueue: the job is evicted whole and saves
        # (policy.kueue). The cohort's are judged by `lends`.
        waiting = [w for w in waiting if w.cohort]
    if last is not None and now - last < timedelta(seconds=YIELD_INTERVAL_S):
        return None
    spare = running - minimum
    if spare < 1:
        return None
    for w in sorted(waiting, key=lambda w: (-w.priority, w.namespace, w.name)):
        if w.priority <= priority or not w.short:
            continue
        need = 0
        for resource, (flavor, amount) in w.short.items():
            each = per_worker.get(resource, Decimal(0))
            if flavors.get(resource) != flavor or each <= 0:
                need = spare + 1  # the job's workers hold none of that: no yield covers it
                break
            need = max(need, math.ceil(amount / each))
        if 1 <= need <= spare:
            short = ", ".join(f"{amount.normalize():f} {r}" for r, (_, amount) in
                              sorted(w.short.items()))
            where = " in the cohort" if w.cohort else ""
            return Yield(need, w, f"gave back {need} worker(s)' quota to Workload{where} "
                                  f"{w.namespace}/{w.name} (priority {w.priority} > {priority}), "
                                  f"which lacked {short}; training goes on with "
                                  f"{running - need} workers (minReplicas {minimum})")
    return None



def outranked(priority: int, waiting: Sequence[Waiting], flavors: Mapping[str, str]) -> bool:
    """A more urgent Workload of the cohort waits for quota of the flavors the job's workers
    hold: the job does not ask to grow meanwhile, since Kueue would give the quota to that
    request first (a Workload that fits its own ClusterQueue comes before one that must
    borrow). In the job's own ClusterQueue Kueue orders by priority, so a request to grow
    waits behind it anyway, and keeps its place (an evicted extra Workload stays queued)."""
    return any(w.cohort and w.priority > priority and w.short
               and all(flavors.get(r) == f for r, (f, _) in w.short.items()) for w in waiting)


@dataclass(frozen=True)
class QueueTerms:
    """What `lends` reads of a ClusterQueue (k8s.kueue_quota.queue_terms)."""

    cohort: str | None = None
    reclaim_within_cohort: str | None = None
    # (flavor, resource) -> the limit, where set.
    lending: Mapping[tuple[str, str], Decimal] = field(default_factory=dict)
    borrowing: Mapping[tuple[str, str], Decimal] = field(default_factory=dict)


def lends(ours: QueueTerms, theirs: QueueTerms, w: Waiting) -> bool:
    """Whether the job, admitted in ClusterQueue `ours`, may yield to `w`, which waits in
    `theirs`: a sibling in the same cohort that Kueue will not reclaim for, and that can borrow
    what it lacks from what the job frees."""
    if not ours.cohort or theirs.cohort != ours.cohort:
        return False
    if (theirs.reclaim_within_cohort or "Never") != "Never":
        return False
    for resource, (flavor, amount) in w.short.items():
        lending = ours.lending.get((flavor, resource))
        borrowing = theirs.borrowing.get((flavor, resource))
        if (lending is not None and lending < amount) \
                or (borrowing is not None and borrowing < amount):
            return False
    return bool(w.short)
