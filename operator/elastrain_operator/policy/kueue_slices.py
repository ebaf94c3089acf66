"""Growing under Kueue through workload slices, where Kueue's ElasticJobsViaWorkloadSlices gate
is on (alpha in 0.17, beta and on by default from 0.18; the chart's kueue.workloadSlices says
so): the job's Workload is a chain of slices instead of one Workload and an extra one.

A job admitted below its desired workers (partial admission, or after giving workers back,
policy.kueue_yield) asks for the rest with a new slice of its own Workload (render.workload's
`render_slice`): the job's pod sets at the desired count, from one worker more than it runs
(below that nothing would grow), annotated as the replacement of the admitted one. Kueue's
scheduler counts the admitted slice's quota as free for it; once it fits, Kueue finishes the
old slice (Finished, reason WorkloadSliceReplaced) and admits the new one, which from then on is
the job's Workload: the running workers stay, the new ones join (in process: at a step
boundary, nobody stops). Unlike an extra Workload, the grown job is preempted whole, as one
Workload, and its spares' and store's pod sets come along.

Kueue finishes the old slice before it writes the new one's admission: in between, the job runs
on the old admission (`handover`), never on none; for HANDOVER_S at most, after which it stops
as any job whose Workload is not admitted (Kueue's own jobs are suspended when that admission
fails). A slice not needed any more (the job stopped,
was evicted, its size changed) is deleted while it holds no quota; the finished ones lose their
finalizer and are deleted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from elastrain_operator.model import conditions as c
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import Phase
from elastrain_operator.policy.status import EventSpec
from elastrain_operator.policy.workload_conditions import conditions_of, is_true
from elastrain_operator.render.meta import Manifest
from elastrain_operator.render.workload import (
    REPLACEMENT_FOR,
    RESOURCE_IN_USE,
    SLICE_REPLACED,
    WORKERS,
    render_slice,
    slice_index,
)

HANDOVER_S = 30.0


@dataclass(frozen=True)
class Chain:
    """The job's Workloads (its extra one aside) as slices."""

    main: Manifest | None  # the job's Workload: the admitted slice, or the one to be
    pending: Manifest | None = None  # a slice asking to replace `main`
    # main's predecessor, finished by Kueue for it before main's admission is written: its
    # admission is what the job runs on until then.
    handover: Manifest | None = None
    retired: tuple[Manifest, ...] = ()  # slices Kueue replaced, still there


def _key(wl: Manifest) -> str:
    meta = wl.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def _replaces(wl: Manifest) -> str | None:
    return ((wl.get("metadata") or {}).get("annotations") or {}).get(REPLACEMENT_FOR)


def replaced(wl: Manifest) -> bool:
    """Kueue finished it for the slice that replaces it."""
    finished = conditions_of(wl).get("Finished") or {}
    return finished.get("status") == "True" and finished.get("reason") == SLICE_REPLACED


def _handing_over(main: Manifest, before: Manifest | None, now: datetime) -> bool:
    """`before` was finished for `main`, which Kueue has not admitted yet (not since)."""
    if before is None or not replaced(before):
        return False
    conds = conditions_of(main)
    if "Admitted" in conds or "Evicted" in conds or is_true(conds, "QuotaReserved"):
        return False  # admitted once: from then on it stands alone
    since = str((conditions_of(before).get("Finished") or {}).get("lastTransitionTime") or "")
    try:
        finished = datetime.fromisoformat(since.replace("Z", "+00:00"))
    except ValueError:
        return False
    return (now - finished).total_seconds() < HANDOVER_S


def chain(workloads: Sequence[Manifest], now: datetime) -> Chain:
    """`workloads`: the job's own (owned by it, its extra one left out)."""
    if not workloads:
        return Chain(None)
    live = [w for w in workloads if not is_true(conditions_of(w), "Finished")]
    keys = {_key(w) for w in live}
    pending = [w for w in live if _replaces(w) in keys]
    mains = sorted((w for w in live if w not in pending), key=slice_index)
    if not mains:  # every one finished (the job ended): the newest is the job's Workload
        main = max(workloads, key=slice_index)
        return Chain(main, retired=tuple(w for w in workloads if w is not main and replaced(w)))
    main = mains[-1]
    by_key = {_key(w): w for w in workloads}
    before = by_key.get(_replaces(main) or "")
    handover = before if _handing_over(main, before, now) else None
    retired = tuple(w for w in workloads if replaced(w) and w is not handover)
    return Chain(main, pending=max(pending, key=slice_index) if pending else None,
                 handover=handover, retired=retired)


@dataclass(frozen=True)
class SliceWrite:
    """What a round does to the job's slices."""

    create: Manifest | None = None
    delete: tuple[Manifest, ...] = ()  # deleted if still as read
    release: tuple[Manifest, ...] = ()  # our finalizer removed
    event: EventSpec | None = None


def _workers_asked(wl: Manifest) -> int:
    return next((int(p.get("count") or 0) for p in (wl.get("spec") or {}).get("podSets") or []
                 if p.get("name") == WORKERS), 0)


def slice_write(job: TrainingJob, found: Chain, *, slices: bool, admitted: bool, base: int,
                phase: Phase) -> SliceWrite:
    """`slices`: the chart says Kueue's gate is on; `admitted`: the job runs on main's own
    admission (not a handover); `base`: the workers it runs under it (admitted less yielded)."""
    release = tuple(w for w in found.retired
                    if RESOURCE_IN_USE in ((w.get("metadata") or {}).get("finalizers") or []))
    delete = [w for w in found.retired
              if w not in release and not (w.get("metadata") or {}).get("deletionTimestamp")]
    wanted = job.spec.desired_workers
    grows = slices and admitted and phase == "Running" and not job.spec.suspend \
        and base < wanted and found.main is not None
    pending = found.pending
    if pending is None:
        if not grows or found.main is None:
            return SliceWrite(delete=tuple(delete), release=release)
        create = render_slice(job, found.main, base + 1)
        name = create["metadata"]["name"]
        return SliceWrite(create=create, delete=tuple(delete), release=release,
                          event=EventSpec("Normal", c.GROWING_BY_SLICE,
                                          f"running {base} of {wanted} workers: Workload slice "
                                          f"{name} asks Kueue for the rest, to replace "
                                          f"{found.main['metadata'].get('name')} once admitted"))
    meta = pending.get("metadata") or {}
    if not is_true(conditions_of(pending), "QuotaReserved") \
            and (meta.get("deletionTimestamp") or not grows
                 or _workers_asked(pending) != wanted
                 or _replaces(pending) != _key(found.main or {})):
        # Not needed, or asking for what the job no longer is: its finalizer goes (it never
        # held quota; the reconcile removes it first) and the slice.
        holds = RESOURCE_IN_USE in (meta.get("finalizers") or [])
        return SliceWrite(delete=(*delete, pending) if not meta.get("deletionTimestamp")
                          else tuple(delete),
                          release=(*release, pending) if holds else release)
    return SliceWrite(delete=tuple(delete), release=release)
