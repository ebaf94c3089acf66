"""Growing under Kueue (issue 36 item 4): the workers a job's admission does not cover come
through a second Workload of its own, admitted and preempted on its own.

Kueue refuses a change of a Workload's pod sets while its quota is reserved, and workload slices
(the alpha ElasticJobsViaWorkloadSlices gate) are off by default in 0.17. So a job admitted below
its desired workers (partial admission), or that gave workers back to a more urgent Workload
(policy.kueue_yield), asks for the rest with an extra Workload (render.workload's
`render_extra_workload`: its LocalQueue and priority, one pod set of the workers' template,
partial admission from one worker up). Admitted, its workers join the running job (in process:
at a step boundary, nobody stops); they take the next worker indices and its flavors' placement.
Evicted (Kueue preempts it like any other Workload: it is the job's most recent admission, so it
goes first), its workers leave at a step boundary and, once their pods are gone, its quota is
given back as the job's own is (released_status) and it waits in the queue again. It is deleted
when it is no longer needed (the job's own admission covers every worker, or the job is not
admitted, once no pod of it is left): it carries no finalizer, so Kueue frees its quota then.
Not for a job with warm spares (their slots follow the workers' and would share indices with
the extra's workers as it comes and goes): such a job runs at what its own admission covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from elastrain_operator.model import conditions as c
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import Phase
from elastrain_operator.policy.failures import WorkerPod
from elastrain_operator.policy.status import EventSpec
from elastrain_operator.policy.workload_conditions import (
    condition,
    conditions_of,
    eviction,
    is_true,
    released_status,
    with_condition,
)
from elastrain_operator.render.meta import Manifest
from elastrain_operator.render.workload import WORKERS, render_extra_workload


@dataclass(frozen=True)
class ExtraWrite:
    """What a round does to the job's extra Workload."""

    create: Manifest | None = None
    status: Manifest | None = None  # a merge patch of its status, with the resourceVersion read
    delete: bool = False
    event: EventSpec | None = None


def extra_workers(extra: Manifest | None) -> int:
    """The workers the extra Workload's admission covers: 0 unless admitted and not evicted."""
    conds = conditions_of(extra or {})
    if not is_true(conds, "Admitted") or is_true(conds, "Evicted"):
        return 0
    admission = ((extra or {}).get("status") or {}).get("admission") or {}
    for assignment in admission.get("podSetAssignments") or []:
        if assignment.get("name") == WORKERS:
            return int(assignment.get("count") or 0)
    return 0


def extra_write(job: TrainingJob, main: Manifest | None, extra: Manifest | None, *,
                admitted: bool, base: int, workers: Sequence[WorkerPod], phase: Phase,
                ready_workers: int, now: datetime) -> ExtraWrite:
    """`admitted`: the job's own Workload is; `base`: the workers it runs under that admission
    (admitted less yielded), the extra's workers taking the indices from there."""
    # Not for a job with spares: their slots follow the workers', so the extra's workers and
    # the spares would share indices as it comes and goes.
    wanted = job.spec.desired_workers - base if not job.spec.spares else 0
    running = admitted and phase == "Running" and not job.spec.suspend
    if extra is None:
        if running and wanted > 0 and main is not None:
            return ExtraWrite(create=render_extra_workload(job, main, wanted))
        return ExtraWrite()
    meta = extra.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return ExtraWrite()
    conds = conditions_of(extra)
    reserved = is_true(conds, "QuotaReserved")
    # Its workers' pods: the indices from `base` up to the desired workers (not spares).
    theirs = [p for p in workers if base <= p.index < job.spec.desired_workers]
    name = meta.get("name")
    if is_true(conds, "Evicted") and reserved:
        if theirs:
            return ExtraWrite()  # they leave first (the gate no longer counts them)
        status, requeue = released_status(extra, now=now)
        return ExtraWrite(
            status={"metadata": {"resourceVersion": meta.get("resourceVersion")},
                    "status": status},
            event=EventSpec("Normal", c.QUOTA_RELEASED,
                            f"the extra workers are gone: Workload {name}'s quota released "
                            f"({eviction(conds)}); " + ("requeued" if requeue else
                                                        "not requeued")))
    count = next((int(p.get("count") or 0) for p in (extra.get("spec") or {}).get("podSets")
                  or [] if p.get("name") == WORKERS), 0)
    if not admitted or job.spec.suspend or phase in ("Succeeded", "Failed") or wanted <= 0 \
            or (not reserved and count != wanted):
        # Not needed (or asking for another count while it holds nothing): deleted once none
        # of its workers is left; asked for again next round where still wanted.
        return ExtraWrite() if theirs and reserved else ExtraWrite(delete=True)
    if is_true(conds, "Admitted"):
        ready = ready_workers >= base + extra_workers(extra)
        if (conds.get("PodsReady") or {}).get("status") != ("True" if ready else "False"):
            gen = int(meta.get("generation") or 0)
            listed = with_condition(list(conds.values()), condition(
                "PodsReady", ready, "PodsReady" if ready else "WaitForStart",
                f"{ready_workers} workers ready", now=now, generation=gen))
            return ExtraWrite(status={"metadata": {"resourceVersion": meta.get("resourceVersion")},
                                      "status": {"conditions": listed}})
    return ExtraWrite()
