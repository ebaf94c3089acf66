"""Kueue: whether a job is queued, what its Workload's admission allows, what to write back.

A job is under Kueue when it carries the `kueue.x-k8s.io/queue-name` label, or when its
namespace had a LocalQueue named `default` when the operator first saw it (what Kueue's webhook
does for its own job kinds; decided once, then kept in status.queue, so a LocalQueue created
later never stops a running job). Such a job creates no pod until Kueue admits its Workload
(render.workload); admitted, it runs at the admitted size (partial admission: between
minReplicas and the desired workers) on the admitted flavors. The operator plays the part Kueue's
jobframework reconciler plays for a batch Job:

- Evicted (preemption, a PodsReady timeout, a stopped ClusterQueue, deactivation, ...): the
  workers are deleted as on a suspend, so each saves its step at the step boundary on SIGTERM;
  once no pod of the job is left the quota is released (admission cleared, QuotaReserved False,
  Requeued True unless deactivated), and Kueue queues the Workload again. Re-admitted, the job
  resumes from that save.
- Suspended (spec.suspend): the Workload is deactivated (spec.active false, marked as ours),
  so Kueue evicts it and the quota is released as above without a requeue: a suspended job
  holds no quota and is not admitted while it cannot run. Resumed, the operator activates it
  again, and it queues anew. A Workload an administrator deactivated stays so.
- PodsReady is kept true while the admitted workers are ready (Kueue's waitForPodsReady would
  evict it otherwise), Finished is set when the job ends, then the finalizer is removed.
- Admitted above minReplicas, it gives workers' quota back to a more urgent Workload that waits
  in its ClusterQueue where Kueue would not preempt for it (policy.kueue_yield): the workers
  leave, and once their pods are gone the Workload's status.reclaimablePods says so.
- Admitted below its size, it asks for the rest with an extra Workload of its own, admitted and
  preempted on its own (policy.kueue_grow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from elastrain_operator.model import conditions as c
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import Phase, QueueState, QueueStatus, TrainingJobStatus
from elastrain_operator.policy.failures import WorkerPod
from elastrain_operator.policy.kueue_grow import ExtraWrite, extra_workers, extra_write
from elastrain_operator.policy.kueue_slices import Chain, SliceWrite, slice_write
from elastrain_operator.policy.kueue_yield import Waiting, Yield, decide_yield, outranked
from elastrain_operator.policy.status import EventSpec, make_condition, set_condition
from elastrain_operator.policy.workload_conditions import (
    condition,
    conditions_of,
    eviction,
    is_true,
    released_status,
    with_condition,
)
from elastrain_operator.render.meta import Manifest
from elastrain_operator.render.workload import (
    DEACTIVATED_BY,
    KUEUE_API,
    POD_SETS_HASH,
    QUEUE_LABEL,
    RESOURCE_IN_USE,
    SPARES,
    STORE,
    SUSPEND,
    WORKERS,
    Placement,
    Priority,
    flavor_placement,
    place,
    pod_sets_hash,
    render_pod_sets,
    render_workload,
    update_placement,
    with_admitted_workers,
    workload_name,
)

DEFAULT_QUEUE = "default"
ADMISSION_GATE = "kueue.x-k8s.io/admission"  # the scheduling gate of Kueue's pod integration
EXTERNAL_FRAMEWORK = "TrainingJob.v1alpha1.elastrain.dev"


@dataclass(frozen=True)
class KueueView:
    """What a round knows of Kueue for one job under it (Observed.kueue)."""

    queue: str
    workload: Manifest | None = None  # the job's Workload as the watch has it; None: none yet
    flavors: Mapping[str, Manifest] = field(default_factory=dict)  # ResourceFlavors, by name
    priority: Priority | None = None  # resolved for a Workload still to be created
    served: bool = True  # the apiserver serves kueue.x-k8s.io/v1beta2 Workloads
    # Shrink to yield (policy.kueue_yield): on (the chart's kueue.yieldQuota), the Workloads
    # waiting in the job's ClusterQueue, its withinClusterQueue preemption policy, and what one
    # worker pod asks for.
    yielding: bool = False
    extra: Manifest | None = None  # the job's extra Workload (policy.kueue_grow), if any
    slices: bool = False  # grow through workload slices (policy.kueue_slices), not `extra`
    chain: Chain = field(default_factory=lambda: Chain(None))  # its slices (workload: main)
    waiting: tuple[Waiting, ...] = ()
    within_cluster_queue: str | None = None
    per_worker: Mapping[str, Decimal] = field(default_factory=dict)


@dataclass(frozen=True)
class Gate:
    """What Kueue lets the job do this round."""

    state: QueueState
    runs: bool  # its pods may exist
    reason: str
    message: str
    workers: int | None = None  # workers the job runs: admitted less yielded plus grown
    yielded: int = 0  # workers given back during this admission (policy.kueue_yield)
    grown: int = 0  # workers the extra Workload's admission adds (policy.kueue_grow)
    base: int = 0  # workers under the job's own admission: the extra's take the indices after
    extra_placement: Placement = field(default_factory=Placement)
    cluster_queue: str = ""
    placement: Mapping[str, Placement] = field(default_factory=dict)  # pod set -> placement


def queue_of(job: TrainingJob, default_queue: bool) -> str | None:
    """The LocalQueue the job waits in, or None when Kueue does not queue it. `default_queue`:
    the namespace has a LocalQueue named `default` (only read for a job never reconciled)."""
    if label := job.metadata.labels.get(QUEUE_LABEL):
        return label
    if job.status.queue is not None:
        return job.status.queue.name
    if default_queue and job.status.observed_generation == 0:
        return DEFAULT_QUEUE
    return None


def derive_gate(job: TrainingJob, view: KueueView) -> Gate:
    """Where the Workload stands, as the job acts on it."""
    name = _name(job, view)
    if not view.served:
        return Gate("Queued", False, c.KUEUE_NOT_SERVED,
                    f"the job names LocalQueue {view.queue!r} but this cluster serves no "
                    f"{KUEUE_API} Workloads: install Kueue (0.16 or later), then restart the "
                    "operator; no pod is created meanwhile")
    wl = view.workload
    if wl is None:
        return Gate("Creating", False, c.QUEUED,
                    f"creating Workload {name} in LocalQueue {view.queue}")
    conds = conditions_of(wl)
    if view.chain.handover is not None:  # Kueue is admitting the slice that replaces it
        return _admitted(job, view, view.chain.handover, handover=True)
    if is_true(conds, "Finished"):
        return Gate("Finished", False, c.QUEUED,
                    f"Workload {name} is finished: {conds['Finished'].get('message', '')}")
    if is_true(conds, "Evicted") and is_true(conds, "QuotaReserved"):
        return Gate("Evicted", False, c.EVICTED_BY_KUEUE,
                    f"Kueue evicted Workload {name} ({eviction(conds)}): the workers save their "
                    "step and stop, then the quota is released")
    if is_true(conds, "Admitted") and not is_true(conds, "Evicted"):
        return _admitted(job, view, wl)
    return Gate("Queued", False, c.QUEUED, _waiting(name, view.queue, wl, conds))


def _waiting(name: str, queue: str, wl: Manifest, conds: Mapping[str, Manifest]) -> str:
    if (wl.get("spec") or {}).get("active") is False:
        return f"Workload {name} is deactivated (spec.active false); it is not queued"
    if is_true(conds, "Evicted"):
        return f"requeued in LocalQueue {queue} after an eviction ({eviction(conds)})"
    reserved = conds.get("QuotaReserved") or {}
    why = reserved.get("message") or "waiting for Kueue to consider it"
    return f"Workload {name} waits in LocalQueue {queue}: {why}"


def _placements(view: KueueView, wl: Manifest) -> tuple[dict[str, Placement], list[str]]:
    """Each admitted pod set's placement (its flavors' node labels and tolerations, and the
    admission checks' podSetUpdates), and the flavors not found."""
    admission = (wl.get("status") or {}).get("admission") or {}
    placement: dict[str, Placement] = {}
    unknown: list[str] = []
    for assignment in admission.get("podSetAssignments") or []:
        pod_set = str(assignment.get("name"))
        here = Placement()
        for flavor in dict.fromkeys((assignment.get("flavors") or {}).values()):
            if str(flavor) in view.flavors:
                here = here.merged(flavor_placement(view.flavors[str(flavor)]))
            else:
                unknown.append(str(flavor))
        for check in (wl.get("status") or {}).get("admissionChecks") or []:
            for update in check.get("podSetUpdates") or []:
                if update.get("name") == pod_set:
                    here = here.merged(update_placement(update))
        placement[pod_set] = here
    return placement, unknown


def _name(job: TrainingJob, view: KueueView) -> str:
    """The job's Workload's name: the first slice's until there is one."""
    if view.workload is not None:
        return str(view.workload["metadata"].get("name"))
    return workload_name(job)


def _admitted(job: TrainingJob, view: KueueView, wl: Manifest, *,
              handover: bool = False) -> Gate:
    admission = (wl.get("status") or {}).get("admission") or {}
    assignments = {str(a.get("name")): a for a in admission.get("podSetAssignments") or []}
    placement, unknown = _placements(view, wl)
    count = (assignments.get(WORKERS) or {}).get("count")
    admitted = int(count) if count is not None else job.spec.desired_workers
    # Given back during this admission (status.queue, reset whenever the job is not admitted,
    # and by a slice that replaces it).
    was = job.status.queue
    here = str(wl["metadata"].get("name"))
    yielded = was.yielded_workers if was is not None and was.state == "Admitted" \
        and was.workload in (here, "") else 0
    yielded = min(yielded, max(admitted - 1, 0))
    queue = str(admission.get("clusterQueue") or "")
    message = f"admitted by ClusterQueue {queue} for {admitted} workers"
    if yielded:
        message += f", {yielded} of them given back to a more urgent Workload"
    grown = extra_workers(view.extra)
    extra_placement = Placement()
    if grown and view.extra is not None:
        found, missing = _placements(view, view.extra)
        extra_placement, unknown = found.get(WORKERS, Placement()), unknown + missing
        message += f", and {grown} more by Workload {view.extra['metadata'].get('name')}"
    if handover and view.workload is not None:
        message += (f"; Workload slice {view.workload['metadata'].get('name')} replaces it "
                    "and is being admitted")
    elif view.chain.pending is not None:
        message += (f"; Workload slice {view.chain.pending['metadata'].get('name')} asks for "
                    f"{job.spec.desired_workers}")
    if unknown:
        message += f" (ResourceFlavors not found, their node labels not applied: {unknown})"
    return Gate("Admitted", True, c.ADMITTED_BY_KUEUE, message,
                workers=admitted - yielded + grown, yielded=yielded, grown=grown,
                base=admitted - yielded, extra_placement=extra_placement,
                cluster_queue=queue, placement=placement)


def _index(manifest: Manifest) -> int:
    return int((manifest["metadata"].get("labels") or {}).get("elastrain.dev/worker-index", 0))


def pod_set_of(manifest: Manifest, job: TrainingJob) -> str:
    """The pod set a pod the planner creates belongs to: the store, a spare's slot (beyond
    the desired workers) or a worker's."""
    labels = manifest["metadata"].get("labels") or {}
    if labels.get("elastrain.dev/role") != "worker":
        return STORE
    index = int(labels.get("elastrain.dev/worker-index", 0))
    return SPARES if index >= job.spec.desired_workers else WORKERS


def gated_pods(workers: Sequence[WorkerPod]) -> list[str]:
    """Our pods that Kueue's pod integration holds with its admission gate: it took them for
    plain pods, since no registered job kind owns them (EXTERNAL_FRAMEWORK)."""
    return sorted(p.name for p in workers if ADMISSION_GATE in p.scheduling_gates)


def queue_status(job: TrainingJob, view: KueueView, gate: Gate) -> QueueStatus:
    was = job.status.queue
    name = str(view.chain.handover["metadata"].get("name")) \
        if view.chain.handover is not None else _name(job, view)
    return QueueStatus(name=view.queue, workload=name, state=gate.state,
                       cluster_queue=gate.cluster_queue, admitted_workers=gate.workers,
                       yielded_workers=gate.yielded,
                       yielded_at=was.yielded_at if was is not None and gate.yielded else None,
                       message=gate.message[:2048])


def worker_flavors(workload: Manifest | None) -> dict[str, str]:
    """resource -> the flavor the admission put the job's workers on."""
    admission = ((workload or {}).get("status") or {}).get("admission") or {}
    for assignment in admission.get("podSetAssignments") or []:
        if assignment.get("name") == WORKERS:
            return {str(k): str(v) for k, v in (assignment.get("flavors") or {}).items()}
    return {}


def yield_now(job: TrainingJob, view: KueueView, gate: Gate, phase: Phase,
              now: datetime) -> Yield | None:
    """Workers to give back this round (policy.kueue_yield), for a job that trains admitted."""
    if not view.yielding or gate.state != "Admitted" or gate.workers is None \
            or phase != "Running" or view.workload is None or gate.grown \
            or view.chain.handover is not None:
        return None  # (not while an extra Workload's workers run: those would leave first)
    was = job.status.queue
    return decide_yield(
        priority=int((view.workload.get("spec") or {}).get("priority") or 0),
        running=gate.workers, minimum=job.spec.min_replicas, per_worker=view.per_worker,
        flavors=worker_flavors(view.workload), waiting=view.waiting,
        within_cluster_queue=view.within_cluster_queue,
        last=was.yielded_at if was is not None else None, now=now)


def admitted_condition(status: TrainingJobStatus, gate: Gate | None, gated: Sequence[str], *,
                       now: datetime, generation: int) -> TrainingJobStatus:
    """The job's Admitted condition: True while Kueue's admission lets its pods run; False
    while Kueue's pod integration gates its pods, also for a job Kueue does not queue (one
    created before its namespace got a `default` LocalQueue)."""
    if gate is None and not gated:
        return status
    reason, message = (gate.reason, gate.message) if gate is not None else ("", "")
    if gated:
        reason = c.PODS_GATED
        message = (f"Kueue's pod integration gates pods {gated[:5]}: add "
                   f"{EXTERNAL_FRAMEWORK} to Kueue's integrations.externalFrameworks so it "
                   "leaves the pods of a queued TrainingJob alone (README, Kueue)")
    cond = make_condition(c.ADMITTED, gate is not None and gate.runs and not gated, reason,
                          message[:32768], now=now, generation=generation)
    return status.model_copy(update={"conditions": set_condition(status.conditions, cond)})


@dataclass(frozen=True)
class WorkloadWrite:
    """A change to the Workload: its status (merge patch with the resourceVersion read, so a
    change by Kueue in between makes it fail and the next round decide again), and whether
    its finalizer goes."""

    status: Manifest | None = None
    # A merge patch of the Workload itself (spec.active and its DEACTIVATED_BY mark), with the
    # resourceVersion read.
    spec: Manifest | None = None
    unfinalize: bool = False
    event: EventSpec | None = None
    # The queue label the job is to carry: one queued in its namespace's `default` LocalQueue
    # gets it, as Kueue's webhook labels its own kinds, so Kueue's pod integration finds its
    # pods' owner managed (with EXTERNAL_FRAMEWORK registered) and leaves them alone.
    label_queue: str | None = None
    extra: ExtraWrite = field(default_factory=ExtraWrite)  # the extra Workload's (kueue_grow)
    slices: SliceWrite = field(default_factory=SliceWrite)  # the slices' (kueue_slices)


def _reclaimable(wl: Manifest, gate: Gate, leaving: int) -> list[Manifest] | None:
    """The Workload's reclaimablePods once the workers given back are gone (`leaving`: worker
    pods beyond gate.workers still there), if that is news to it. Only ever grows: Kueue
    refuses a smaller count while the quota is reserved."""
    if not gate.yielded or leaving:
        return None
    listed = list((wl.get("status") or {}).get("reclaimablePods") or [])
    have = next((int(r.get("count") or 0) for r in listed if r.get("name") == WORKERS), 0)
    if have >= gate.yielded:
        return None
    return [*(r for r in listed if r.get("name") != WORKERS),
            {"name": WORKERS, "count": gate.yielded}]


def workload_write(job: TrainingJob, view: KueueView, gate: Gate, *, pods_left: bool,
                   ready_workers: int, phase: Phase, now: datetime,
                   leaving: int = 0) -> WorkloadWrite:
    """What this round writes to the Workload, if anything. `leaving`: worker pods beyond
    those the job now runs (and its spares), still there."""
    wl = view.workload
    if wl is None or view.chain.handover is not None:
        # (During a handover the Workload is the slice Kueue is admitting: left to Kueue.)
        label = view.queue if job.metadata.labels.get(QUEUE_LABEL) != view.queue else None
        return WorkloadWrite(label_queue=label)
    meta = wl.get("metadata") or {}
    conds = conditions_of(wl)
    ours = RESOURCE_IN_USE in (meta.get("finalizers") or [])
    gen = int(meta.get("generation") or 0)
    listed: list[Manifest] = list(conds.values())
    status: dict[str, Any] = {}
    event = None
    if gate.state == "Evicted" and not pods_left:
        status, requeue = released_status(wl, now=now)
        listed = status.pop("conditions")
        event = EventSpec("Normal", c.QUOTA_RELEASED,
                          f"no pod of the job is left: Workload {meta.get('name')}'s quota "
                          f"released ({eviction(conds)}); "
                          + ("requeued" if requeue else "not requeued"))
    elif phase in ("Succeeded", "Failed") and not is_true(conds, "Finished"):
        listed = with_condition(listed, condition(
            "Finished", True, phase, f"the TrainingJob {phase}", now=now, generation=gen))
    elif gate.runs and gate.workers is not None:
        ready = ready_workers >= gate.workers
        if (conds.get("PodsReady") or {}).get("status") != ("True" if ready else "False"):
            listed = with_condition(listed, condition(
                "PodsReady", ready, "PodsReady" if ready else "WaitForStart",
                f"{ready_workers} of {gate.workers} admitted workers ready", now=now,
                generation=gen))
        if reclaimable := _reclaimable(wl, gate, leaving):
            status["reclaimablePods"] = reclaimable
    if listed != list(conds.values()):
        status["conditions"] = listed
    unfinalize = ours and (bool(meta.get("deletionTimestamp")) or is_true(conds, "Finished"))
    version = {"resourceVersion": meta.get("resourceVersion")}
    patch = {"metadata": version, "status": status} if status else None
    label = view.queue if job.metadata.labels.get(QUEUE_LABEL) != view.queue else None
    spec = None
    if phase not in ("Succeeded", "Failed") and not meta.get("deletionTimestamp"):
        spec = _spec_patch(job, wl, reserved=is_true(conds, "QuotaReserved"),
                           pods_left=pods_left)
    if spec:
        spec["metadata"].update(version)
    return WorkloadWrite(status=patch, spec=spec,
                         event=event, unfinalize=unfinalize, label_queue=label)


def _spec_patch(job: TrainingJob, wl: Manifest, *, reserved: bool,
                pods_left: bool = False) -> Manifest | None:
    """What the Workload's spec is to become (a status patch cannot carry it):

    - spec.active: false for a suspended job once no pod of it is left (Kueue stops counting
      a deactivated Workload's quota at once, and the pods are inside it until they are gone);
      true again once the job is resumed, for the Workload we deactivated only (an
      administrator's deactivation stays);
    - spec.podSets: rendered again when the job's spec changed while the Workload holds no
      quota (Kueue refuses a change of a reserved Workload's pod sets: an admitted job runs at
      its admission until it is evicted and queued again)."""
    meta = wl.get("metadata") or {}
    notes = meta.get("annotations") or {}
    active = (wl.get("spec") or {}).get("active") is not False
    annotations: dict[str, str | None] = {}
    spec: Manifest = {}
    if job.spec.suspend and active and not pods_left:
        annotations[DEACTIVATED_BY] = SUSPEND
        spec["active"] = False
    elif not job.spec.suspend and not active and notes.get(DEACTIVATED_BY) == SUSPEND:
        annotations[DEACTIVATED_BY] = None
        spec["active"] = True
    if not reserved:
        pod_sets = render_pod_sets(job)
        if notes.get(POD_SETS_HASH) != (digest := pod_sets_hash(pod_sets)):
            annotations[POD_SETS_HASH] = digest
            spec["podSets"] = pod_sets
    if not spec:
        return None
    return {"metadata": {"annotations": annotations}, "spec": spec}


def place_pods(create: Sequence[Manifest], job: TrainingJob,
               gate: Gate) -> tuple[list[Manifest], list[EventSpec]]:
    """The pods a round creates, on the flavors Kueue admitted them to (render.workload); a pod
    whose placement conflicts with its own node selector is not created, and said so."""
    placed: list[Manifest] = []
    events: list[EventSpec] = []
    for manifest in create:
        if manifest["kind"] != "Pod":
            placed.append(manifest)
            continue
        pod_set = pod_set_of(manifest, job)
        if pod_set != STORE and gate.workers is not None \
                and gate.workers < job.spec.desired_workers:
            manifest = with_admitted_workers(manifest, gate.workers)
        where = gate.placement.get(pod_set, Placement())
        if pod_set == WORKERS and gate.grown and gate.base <= _index(manifest):
            where = gate.extra_placement  # a worker the extra Workload's admission covers
        try:
            placed.append(place(manifest, where))
        except ValueError as err:
            events.append(EventSpec("Warning", c.CREATE_FAILED,
                                    f"pod {manifest['metadata']['name']}: {err}"))
    return placed, events


def kueue_status(status: TrainingJobStatus, job: TrainingJob, view: KueueView, gate: Gate,
                 workers: Sequence[WorkerPod], *, store: bool, ready_workers: int,
                 blocked: bool, now: datetime
                 ) -> tuple[TrainingJobStatus, Manifest | None, WorkloadWrite]:
    """status.queue and the Admitted condition; the Workload to create, or what to write to
    it. `store`: the job's store pod exists."""
    queue = queue_status(job, view, gate)
    yielding = yield_now(job, view, gate, status.phase, now)
    if yielding is not None:
        queue = queue.model_copy(update={"yielded_workers": gate.yielded + yielding.workers,
                                         "yielded_at": now})
    status = admitted_condition(
        status.model_copy(update={"queue": queue}), gate,
        gated_pods(workers), now=now, generation=job.metadata.generation)
    creating = gate.state == "Creating" and view.served and not blocked \
        and status.phase not in ("Succeeded", "Failed")
    create = render_workload(job, view.queue, view.priority) if creating else None
    # The worker pods (spares too) beyond what the job now runs: the ones given back, until
    # their pods are gone.
    leaving = max(0, len(workers) - (gate.workers or 0) - job.spec.spares)
    write = workload_write(job, view, gate, pods_left=bool(workers) or store,
                           ready_workers=ready_workers, phase=status.phase, now=now,
                           leaving=leaving)
    admitted = gate.state == "Admitted" and view.chain.handover is None \
        and not outranked(int(((view.workload or {}).get("spec") or {}).get("priority") or 0),
                          view.waiting, worker_flavors(view.workload))
    # With slices the job grows by them, not by an extra Workload (one left is let go).
    extra = extra_write(job, view.workload, view.extra, admitted=admitted and not view.slices,
                        base=gate.base, workers=workers, phase=status.phase,
                        ready_workers=ready_workers, now=now)
    slices = slice_write(job, view.chain, slices=view.slices, admitted=admitted,
                         base=gate.base, phase=status.phase)
    # One event a round: the yield's, the job's Workload's, else the extra one's or a slice's.
    event = (EventSpec("Normal", c.YIELDED_QUOTA, yielding.message) if yielding is not None
             else write.event or extra.event or slices.event)
    write = dataclasses.replace(write, event=event, extra=extra, slices=slices)
    return status, create, write
