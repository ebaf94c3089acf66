"""Shrink to yield (issue 36 item 4): an elastic job gives Kueue back the quota of some of its
workers for a Workload of a higher priority that waits in the same ClusterQueue and that Kueue
will not preempt anything for.

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

Kueue lets reclaimablePods only grow while the quota is reserved, so the workers given back come
back through the job's extra Workload (policy.kueue_grow), admitted on its own when quota frees,
or with the job's next admission. No yield while the extra Workload's workers run (they hold the
indices above the job's own admission and would have to leave first).
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
        return None  # Kueue preempts for it: the job is evicted whole and saves (policy.kueue)
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
            return Yield(need, w, f"gave back {need} worker(s)' quota to Workload "
                                  f"{w.namespace}/{w.name} (priority {w.priority} > {priority}), "
                                  f"which lacked {short}; training goes on with "
                                  f"{running - need} workers (minReplicas {minimum})")
    return None
