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
from elastrain_operator.policy.kueue_yield import Waiting, Yield, decide_yield
from elastrain_operator.policy.status import EventSpec, make_condition, set_condition
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
# Kueue's eviction reasons after which its own integrations requeue (jobframework step 6).
REQUEUED_AFTER = ("Preempted", "AdmissionCheck")
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
    workers: int | None = None  # workers the job runs: admitted less yielded (runs only)
    yielded: int = 0  # workers given back during this admission (policy.kueue_yield)
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


def _conditions(workload: Manifest) -> dict[str, Manifest]:
    return {str(x.get("type")): x for x in (workload.get("status") or {}).get("conditions") or []}


def _true(conds: Mapping[str, Manifest], kind: str) -> bool:
    return (conds.get(kind) or {}).get("status") == "True"


def derive_gate(job: TrainingJob, view: KueueView) -> Gate:
    """Where the Workload stands, as the job acts on it."""
    name = workload_name(job)
    if not view.served:
        return Gate("Queued", False, c.KUEUE_NOT_SERVED,
                    f"the job names LocalQueue {view.queue!r} but this cluster serves no "
                    f"{KUEUE_API} Workloads: install Kueue (0.16 or later), then restart the "
                    "operator; no pod is created meanwhile")
    wl = view.workload
    if wl is None:
        return Gate("Creating", False, c.QUEUED,
                    f"creating Workload {name} in LocalQueue {view.queue}")
    conds = _conditions(wl)
    if _true(conds, "Finished"):
        return Gate("Finished", False, c.QUEUED,
                    f"Workload {name} is finished: {conds['Finished'].get('message', '')}")
    if _true(conds, "Evicted") and _true(conds, "QuotaReserved"):
        return Gate("Evicted", False, c.EVICTED_BY_KUEUE,
                    f"Kueue evicted Workload {name} ({eviction(conds)}): the workers save their "
                    "step and stop, then the quota is released")
    if _true(conds, "Admitted") and not _true(conds, "Evicted"):
        return _admitted(job, view, wl)
    return Gate("Queued", False, c.QUEUED, _waiting(name, view.queue, wl, conds))


def eviction(conds: Mapping[str, Manifest]) -> str:
    """Kueue's reason for an eviction, and by whom when it preempted."""
    evicted = conds.get("Evicted") or {}
    why = str(evicted.get("reason") or "Evicted")
    if _true(conds, "Preempted"):
        why += f", {conds['Preempted'].get('reason')}"
    message = str(evicted.get("message") or "")
    return f"{why}: {message}" if message else why


def _waiting(name: str, queue: str, wl: Manifest, conds: Mapping[str, Manifest]) -> str:
    if (wl.get("spec") or {}).get("active") is False:
        return f"Workload {name} is deactivated (spec.active false); it is not queued"
    if _true(conds, "Evicted"):
        return f"requeued in LocalQueue {queue} after an eviction ({eviction(conds)})"
    reserved = conds.get("QuotaReserved") or {}
    why = reserved.get("message") or "waiting for Kueue to consider it"
    return f"Workload {name} waits in LocalQueue {queue}: {why}"


def _admitted(job: TrainingJob, view: KueueView, wl: Manifest) -> Gate:
    admission = (wl.get("status") or {}).get("admission") or {}
    assignments = {str(a.get("name")): a for a in admission.get("podSetAssignments") or []}
    placement: dict[str, Placement] = {}
    unknown: list[str] = []
    for pod_set, assignment in assignments.items():
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
    count = (assignments.get(WORKERS) or {}).get("count")
    admitted = int(count) if count is not None else job.spec.desired_workers
    # Given back during this admission (status.queue, reset whenever the job is not admitted).
    was = job.status.queue
    yielded = was.yielded_workers if was is not None and was.state == "Admitted" else 0
    yielded = min(yielded, max(admitted - 1, 0))
    queue = str(admission.get("clusterQueue") or "")
    message = f"admitted by ClusterQueue {queue} for {admitted} workers"
    if yielded:
        message += f", {yielded} of them given back to a more urgent Workload"
    if unknown:
        message += f" (ResourceFlavors not found, their node labels not applied: {unknown})"
    return Gate("Admitted", True, c.ADMITTED_BY_KUEUE, message, workers=admitted - yielded,
                yielded=yielded, cluster_queue=queue, placement=placement)


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
    return QueueStatus(name=view.queue, workload=workload_name(job), state=gate.state,
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
            or phase != "Running" or view.workload is None:
        return None
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


def _condition(kind: str, status: bool, reason: str, message: str, *, now: datetime,
               generation: int) -> Manifest:
    return {"type": kind, "status": "True" if status else "False", "reason": reason,
            "message": message[:32768], "lastTransitionTime": now.isoformat(),
            "observedGeneration": generation}


def _with(conds: list[Manifest], new: Manifest) -> list[Manifest]:
    """Set a condition as metav1 does: its transition time kept while its status stays."""
    out, found = [], False
    for cond in conds:
        if cond.get("type") != new["type"]:
            out.append(cond)
            continue
        found = True
        same = cond.get("status") == new["status"]
        out.append({**new, "lastTransitionTime": cond.get("lastTransitionTime")} if same
                   else new)
    return out if found else [*out, new]


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
    if wl is None:
        label = view.queue if job.metadata.labels.get(QUEUE_LABEL) != view.queue else None
        return WorkloadWrite(label_queue=label)
    meta = wl.get("metadata") or {}
    conds = _conditions(wl)
    ours = RESOURCE_IN_USE in (meta.get("finalizers") or [])
    gen = int(meta.get("generation") or 0)
    listed: list[Manifest] = list(conds.values())
    status: dict[str, Any] = {}
    event = None
    if gate.state == "Evicted" and not pods_left:
        evicted = conds.get("Evicted") or {}
        reason = str(evicted.get("reason") or "Evicted")
        message = str(evicted.get("message") or "")
        requeue = reason in REQUEUED_AFTER
        for new in (_condition("QuotaReserved", False, "Pending", message, now=now,
                               generation=gen),
                    _condition("Admitted", False, "NoReservation",
                               "The workload has no reservation", now=now, generation=gen),
                    _condition("Requeued", requeue, reason, message, now=now, generation=gen)):
            listed = _with(listed, new)
        status["admission"] = None
        status["reclaimablePods"] = None  # the next admission counts every pod set anew
        event = EventSpec("Normal", c.QUOTA_RELEASED,
                          f"no pod of the job is left: Workload {meta.get('name')}'s quota "
                          f"released ({eviction(conds)}); "
                          + ("requeued" if requeue else "not requeued"))
    elif phase in ("Succeeded", "Failed") and not _true(conds, "Finished"):
        listed = _with(listed, _condition("Finished", True, phase, f"the TrainingJob {phase}",
                                          now=now, generation=gen))
    elif gate.runs and gate.workers is not None:
        ready = ready_workers >= gate.workers
        if (conds.get("PodsReady") or {}).get("status") != ("True" if ready else "False"):
            listed = _with(listed, _condition(
                "PodsReady", ready, "PodsReady" if ready else "WaitForStart",
                f"{ready_workers} of {gate.workers} admitted workers ready", now=now,
                generation=gen))
        if reclaimable := _reclaimable(wl, gate, leaving):
            status["reclaimablePods"] = reclaimable
    if listed != list(conds.values()):
        status["conditions"] = listed
    unfinalize = ours and (bool(meta.get("deletionTimestamp")) or _true(conds, "Finished"))
    version = {"resourceVersion": meta.get("resourceVersion")}
    patch = {"metadata": version, "status": status} if status else None
    label = view.queue if job.metadata.labels.get(QUEUE_LABEL) != view.queue else None
    spec = None
    if phase not in ("Succeeded", "Failed") and not meta.get("deletionTimestamp"):
        spec = _spec_patch(job, wl, reserved=_true(conds, "QuotaReserved"))
    if spec:
        spec["metadata"].update(version)
    return WorkloadWrite(status=patch, spec=spec,
                         event=event, unfinalize=unfinalize, label_queue=label)


def _spec_patch(job: TrainingJob, wl: Manifest, *, reserved: bool) -> Manifest | None:
    """What the Workload's spec is to become (a status patch cannot carry it):

    - spec.active: false for a suspended job; true again once the job is resumed, for the
      Workload we deactivated only (an administrator's deactivation stays);
    - spec.podSets: rendered again when the job's spec changed while the Workload holds no
      quota (Kueue refuses a change of a reserved Workload's pod sets: an admitted job runs at
      its admission until it is evicted and queued again)."""
    meta = wl.get("metadata") or {}
    notes = meta.get("annotations") or {}
    active = (wl.get("spec") or {}).get("active") is not False
    annotations: dict[str, str | None] = {}
    spec: Manifest = {}
    if job.spec.suspend and active:
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
        try:
            placed.append(place(manifest, gate.placement.get(pod_set, Placement())))
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
    if yielding is not None:
        write = dataclasses.replace(write, event=EventSpec("Normal", c.YIELDED_QUOTA,
                                                           yielding.message))
    return status, create, write
