"""Status derivation: phase, conditions and the transition events, from what the planner decided.

Phase: Failed/Succeeded are terminal and sticky. Otherwise Suspended while spec.suspend; Running
while at least minReplicas worker pods run (a warm spare counts: it takes a lost worker's place at
once); Restarting when a job that was running fell below minReplicas; Pending before it first got
there. AllWorkersRunning needs the spares too; readyReplicas and WORKERS count no waiting
spare. Conditions keep their lastTransitionTime while their status does not change. Events are
derived by comparing the old and new conditions, so every transition is announced once, after
the status write that made it; so is each new checkpoint fallback (policy.fallback), which
leaves CheckpointFallback True.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from elastrain_operator.model import conditions as c
from elastrain_operator.model.names import worker_selector
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import (
    CheckpointFallback,
    CheckpointRef,
    Condition,
    ConditionStatus,
    Phase,
    Progress,
    RendezvousStoreState,
    TrainingJobStatus,
    TrainingRecovery,
    WorkerLoss,
    WorkerSlot,
)
from elastrain_operator.policy.checkpoints import checkpoints_condition
from elastrain_operator.policy.fallback import describe_fallback, fallback_condition
from elastrain_operator.policy.store import StoreReadiness

TERMINAL: tuple[Phase, ...] = ("Succeeded", "Failed")
# Condition types whose changes are announced as events, in a stable order.
ANNOUNCED = (c.VALID, c.CREATED, c.SUSPENDED, c.ADMITTED, c.RUNNING, c.RESTARTING,
             c.ALL_WORKERS_RUNNING, c.SUCCEEDED, c.FAILED, c.CHECKPOINTS_FAILING,
             c.RENDEZVOUS_STORE_READY)
WARNING_REASONS = frozenset({
    c.INVALID_SPEC, c.BELOW_MIN_REPLICAS, c.WORKER_PREEMPTED, c.WORKER_FAILED, c.BACKOFF,
    c.WORKERS_PENDING, c.MAX_RESTARTS_EXCEEDED, c.MAX_PREEMPTIONS_EXCEEDED, c.DEADLINE_EXCEEDED,
    c.CREATE_FAILED, c.CHECKPOINT_SAVE_FAILED, c.STORE_IMAGE_PULL_FAILED, c.STORE_CRASH_LOOPING,
    c.STORE_UNSCHEDULABLE, c.STORE_CONTAINER_FAILED, c.STORE_LOST, c.WAITING_FOR_STORE,
    c.RENDEZVOUS_STORE_NOT_READY, c.CONFIGURATION_ERROR, c.EVICTED_BY_KUEUE, c.PODS_GATED,
    c.KUEUE_NOT_SERVED,
})


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class WorkerCounts:
    """The current pods of the active slots (desired workers plus warm spares)."""

    desired: int = 0  # workers (members of the world); status.replicas
    spares: int = 0  # warm spares kept beyond them (spec.spares)
    running: int = 0
    ready: int = 0
    ready_spares: int = 0  # of the ready pods, those whose trainer waits as a spare
    pending: int = 0
    unschedulable: str = ""  # the scheduler's message for one unschedulable worker

    @property
    def ready_workers(self) -> int:
        """Ready pods that are not waiting spares; never more than desired (a spare the poll
        did not reach is not taken for a member)."""
        return min(max(self.ready - self.ready_spares, 0), self.desired)

    @property
    def wanted(self) -> str:
        """What the job keeps, in words: "3 workers", or "3 workers + 1 spare"."""
        if not self.spares:
            return f"{self.desired} workers"
        return f"{self.desired} workers + {self.spares} spare{'s' if self.spares > 1 else ''}"


@dataclass(frozen=True)
class Accounting:
    """The counters and bookkeeping after this round's counting."""

    slots: tuple[WorkerSlot, ...] = ()
    losses: tuple[WorkerLoss, ...] = ()
    restarts: int = 0
    preemptions: int = 0
    backoff_until: datetime | None = None
    recovering_since: datetime | None = None
    last_loss_reason: str = ""
    store: RendezvousStoreState | None = None  # the store attempt (policy.store)


@dataclass(frozen=True)
class Outcome:
    """What the planner decided this round, beyond counting."""

    problems: tuple[str, ...] = ()
    blocked: bool = False  # a problem of the spec itself: no pod is created
    terminal: tuple[Phase, str, str] | None = None  # phase, reason, message
    created: bool = False
    finishing: bool = False
    in_backoff: bool = False
    progress: tuple[Progress | None, CheckpointRef | None] = field(default=(None, None))
    last_recovery: TrainingRecovery | None = None  # None: keep the status's
    fallback: CheckpointFallback | None = None  # a new one this round; None: keep the status's
    store: StoreReadiness | None = None  # the store pod's readiness; None: keep the condition
    store_hold: datetime | None = None  # missing workers wait for the store until then
    queued: bool = False  # Kueue has not admitted the job (or took its quota back)


def make_condition(kind: str, status: bool, reason: str, message: str, *,
                   now: datetime, generation: int) -> Condition:
    value: ConditionStatus = "True" if status else "False"
    return Condition(type=kind, status=value, reason=reason, message=message,
                     last_transition_time=now, observed_generation=generation)


def set_condition(existing: Sequence[Condition], new: Condition) -> list[Condition]:
    """Replace the condition of new's type, keeping lastTransitionTime if status is unchanged."""
    out: list[Condition] = []
    found = False
    for cond in existing:
        if cond.type != new.type:
            out.append(cond)
            continue
        found = True
        if cond.status == new.status:
            new = new.model_copy(update={"last_transition_time": cond.last_transition_time})
        out.append(new)
    if not found:
        out.append(new)
    return out


def find_condition(conds: Sequence[Condition], kind: str) -> Condition | None:
    return next((x for x in conds if x.type == kind), None)


def derive_phase(job: TrainingJob, counts: WorkerCounts, outcome: Outcome) -> Phase:
    if outcome.terminal is not None:
        return outcome.terminal[0]
    if job.status.phase in TERMINAL:
        return job.status.phase
    if job.spec.suspend:
        return "Suspended"
    if outcome.queued:
        return "Queued"
    if counts.running >= job.spec.min_replicas:
        return "Running"
    if job.status.phase in ("Running", "Restarting"):
        return "Restarting"
    return "Pending"


def _running_condition(phase: Phase, job: TrainingJob, counts: WorkerCounts,
                       outcome: Outcome) -> tuple[bool, str, str]:
    spec = job.spec
    if phase == "Running":
        reason = c.JOB_FINISHING if outcome.finishing else c.WORKERS_RUNNING
        return True, reason, (f"{counts.running} of {counts.wanted} running "
                              f"(minReplicas {spec.min_replicas})")
    if phase in TERMINAL:
        return False, c.JOB_TERMINATED, f"the job {phase.lower()}"
    if phase == "Suspended":
        return False, c.JOB_SUSPENDED, "spec.suspend is true"
    if phase == "Queued":
        return False, c.QUEUED, "Kueue has not admitted the job (see the Admitted condition)"
    if outcome.blocked:
        return False, c.INVALID_SPEC, "the spec is invalid; see the Valid condition"
    reason = c.BELOW_MIN_REPLICAS if phase == "Restarting" else c.WORKERS_STARTING
    return False, reason, (f"{counts.running} of minReplicas {spec.min_replicas} workers "
                           "running")


def _all_running_condition(phase: Phase, counts: WorkerCounts, outcome: Outcome,
                           acct: Accounting) -> tuple[bool, str, str]:
    if phase in TERMINAL:
        return False, c.JOB_TERMINATED, f"the job {phase.lower()}"
    if phase == "Suspended":
        return False, c.JOB_SUSPENDED, "spec.suspend is true"
    if phase == "Queued":
        return False, c.QUEUED, "Kueue has not admitted the job (see the Admitted condition)"
    if counts.desired and counts.running >= counts.desired + counts.spares:
        return True, c.WORKERS_RUNNING, f"all {counts.wanted} running"
    if outcome.store_hold is not None:
        return False, c.WAITING_FOR_STORE, (
            "replacing workers lost to the rendezvous store after "
            f"{outcome.store_hold.isoformat()}, or once it is Ready")
    if outcome.in_backoff and acct.backoff_until is not None:
        return False, c.BACKOFF, ("replacing a failed worker after "
                                  f"{acct.backoff_until.isoformat()}")
    message = f"{counts.running} of {counts.wanted} running, {counts.pending} pending"
    if counts.unschedulable:
        message += f" ({counts.unschedulable})"
    return False, c.WORKERS_PENDING, message


def _restarting_condition(acct: Accounting, outcome: Outcome) -> tuple[bool, str, str]:
    if acct.recovering_since is None:
        return False, c.NOT_RESTARTING, "no worker is being replaced"
    reason = c.BACKOFF if outcome.in_backoff else (acct.last_loss_reason or c.WORKER_PREEMPTED)
    return True, reason, f"replacing lost workers since {acct.recovering_since.isoformat()}"


def _conditions(job: TrainingJob, phase: Phase, counts: WorkerCounts, outcome: Outcome,
                acct: Accounting, now: datetime) -> list[Condition]:
    gen = job.metadata.generation
    conds = list(job.status.conditions)

    def put(kind: str, value: tuple[bool, str, str]) -> None:
        nonlocal conds
        conds = set_condition(conds, make_condition(kind, *value, now=now, generation=gen))

    put(c.VALID, (False, c.INVALID_SPEC, "; ".join(outcome.problems)) if outcome.problems
        else (True, c.SPEC_VALID, "the spec passed every check"))
    if outcome.created or find_condition(conds, c.CREATED):
        put(c.CREATED, (True, c.JOB_CREATED, "service, rendezvous store and workers created"))
    was_suspended = find_condition(job.status.conditions, c.SUSPENDED)
    resumed = was_suspended is not None and (was_suspended.status == "True"
                                             or was_suspended.reason == c.JOB_RESUMED)
    put(c.SUSPENDED, (True, c.JOB_SUSPENDED, "workers deleted; resume by clearing spec.suspend")
        if phase == "Suspended" else
        (False, c.JOB_RESUMED if resumed else c.NOT_SUSPENDED, "spec.suspend is false"))
    put(c.RUNNING, _running_condition(phase, job, counts, outcome))
    put(c.RESTARTING, _restarting_condition(acct, outcome))
    put(c.ALL_WORKERS_RUNNING, _all_running_condition(phase, counts, outcome, acct))
    if outcome.terminal is not None:
        kind = c.SUCCEEDED if outcome.terminal[0] == "Succeeded" else c.FAILED
        put(kind, (True, outcome.terminal[1], outcome.terminal[2]))
    if (checkpoints := checkpoints_condition(*outcome.progress)) is not None:
        put(c.CHECKPOINTS_FAILING, checkpoints)
    if (fallback := fallback_condition(outcome.fallback or job.status.checkpoint_fallback)):
        put(c.CHECKPOINT_FALLBACK, fallback)
    if (experimental := job.spec.experimental) is not None:
        put(c.EXPERIMENTAL, (True, c.IN_PROCESS_ON_GPU, experimental))
    elif find_condition(conds, c.EXPERIMENTAL):  # an update took the job off that path
        put(c.EXPERIMENTAL, (False, c.VERIFIED, "the job's recovery mode is verified"))
    if phase == "Suspended":
        put(c.RENDEZVOUS_STORE_READY, (False, c.JOB_SUSPENDED, "spec.suspend is true"))
    elif phase == "Queued":
        put(c.RENDEZVOUS_STORE_READY, (False, c.QUEUED, "Kueue has not admitted the job"))
    elif outcome.store is not None:
        put(c.RENDEZVOUS_STORE_READY, (outcome.store.ready, outcome.store.reason,
                                       outcome.store.message))
    return conds


def derive_status(job: TrainingJob, counts: WorkerCounts, outcome: Outcome, acct: Accounting,
                  *, now: datetime) -> TrainingJobStatus:
    old = job.status
    phase = derive_phase(job, counts, outcome)
    # A queued job keeps its start time: an eviction by Kueue resumes the same run.
    active = phase not in TERMINAL and phase not in ("Suspended", "Queued") \
        and not outcome.blocked
    start = (old.start_time or now) if active else (None if phase == "Suspended"
                                                    else old.start_time)
    progress, checkpoint = outcome.progress
    terminal = phase in TERMINAL
    return old.model_copy(update={
        "phase": phase,
        "conditions": _conditions(job, phase, counts, outcome, acct, now),
        "replicas": counts.desired,
        "ready_replicas": counts.ready_workers,
        "workers": f"{counts.ready_workers}/{counts.desired}",
        "ready_spares": counts.ready_spares if counts.spares else None,
        "recovery_mode": job.spec.recovery_mode,
        "pending_replicas": counts.pending,
        "selector": worker_selector(job.metadata.name),
        "restarts": acct.restarts,
        "preemptions": acct.preemptions,
        "restart_backoff_until": None if terminal else acct.backoff_until,
        "last_checkpoint": checkpoint,
        "progress": progress,
        "slots": list(acct.slots),
        "recent_losses": list(acct.losses),
        "recovering_since": None if terminal else acct.recovering_since,
        "last_recovery": outcome.last_recovery or old.last_recovery,
        "checkpoint_fallback": outcome.fallback or old.checkpoint_fallback,
        "rendezvous_store": acct.store,
        "start_time": start,
        "completion_time": old.completion_time or (now if terminal else None),
        "observed_generation": job.metadata.generation,
    })


def transition_events(old: TrainingJobStatus, new: TrainingJobStatus) -> list[EventSpec]:
    """One event per announced condition whose status or reason changed."""
    events: list[EventSpec] = []
    for kind in ANNOUNCED:
        after = find_condition(new.conditions, kind)
        if after is None:
            continue
        before = find_condition(old.conditions, kind)
        if before is None:
            if after.status != "True" and kind != c.VALID:
                continue
            if kind == c.VALID and after.status == "True":
                continue
        elif (before.status, before.reason) == (after.status, after.reason):
            continue
        level = "Warning" if after.reason in WARNING_REASONS else "Normal"
        events.append(EventSpec(level, after.reason, f"{kind}={after.status}: {after.message}"))
    return events


def fallback_events(old: TrainingJobStatus, new: TrainingJobStatus) -> list[EventSpec]:
    """A Warning event when the written status holds a checkpoint fallback the old one did not
    (policy.fallback): once per fallback, also while CheckpointFallback is already True."""
    fb = new.checkpoint_fallback
    if fb is None or fb == old.checkpoint_fallback:
        return []
    return [EventSpec("Warning", c.DAMAGED_CHECKPOINT_SKIPPED,
                      f"{c.CHECKPOINT_FALLBACK}=True: {describe_fallback(fb)}")]
