"""The planner: a TrainingJob and its observed children -> the status and the children it needs.

Reads as the steps of one reconcile, each a pure function of its inputs and `now`:
1. account (policy.accounting): count each lost worker once (slot attempts, see WorkerSlot),
   retire slots that a scale-down, a suspend or Kueue's hold (policy.kueue) no longer wants; a
   worker lost to a rendezvous store that has never been Ready is the store's loss, neither
   preemption nor failure (policy.store);
   a job that completed no step for spec.hangTimeoutSeconds restarts its workers as one counted
   failure (policy.hang);
2. decide: a worker's configuration error (no restart can fix it), budget spent, deadline
   passed, the store never Ready in time, or every trainer finished -> terminal;
3. converge: the Services, the NetworkPolicy (when the operator renders them: render.network),
   the rendezvous store and one pod per active slot (those lost to the
   store after its backoff, or once it is Ready); stale pods go;
4. derive the status (written first by the shell) and the events announcing its transitions,
   including how long training took to run again after the newest loss (policy.progress)
   and a resume that skipped a damaged checkpoint (policy.fallback).

Warm spares (spec.spares, docs/recovery.md section 9): the job keeps desired + spares worker
slots, every one a worker pod like any other (created, counted when lost, replaced); which pods
train and which wait is the trainers' choice, told in /progress `role`. So spares change the pod
count only: status.replicas and the WORKERS column stay members/desired (readyReplicas leaves
out status.readySpares), a spare's report is never the job's step nor its liveness, and the job is
back to its size once desired workers run again (a spare takes a lost worker's place at once).

Success, precisely: torchrun exits 0 only when its worker group completed, so the first worker
pod that Succeeded (exit 0 and no disruption) means the world finished training. From then on
the job is finishing: nothing is counted or replaced, and it Succeeds once no worker of the job
is Running any more (workers still pending never started and are deleted). A worker that merely
Succeeded while its peers still run does not end the job.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from elastrain_operator.model import conditions as c
from elastrain_operator.model.names import store_name
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import (
    Phase,
    TrainingRecovery,
)
from elastrain_operator.policy.accounting import account
from elastrain_operator.policy.converge import cleanup_stale, converge, ensure_slots, finish
from elastrain_operator.policy.failures import (
    Exit,
    classify_pod_exit,
    finish_warning,
)
from elastrain_operator.policy.fallback import newest_fallback
from elastrain_operator.policy.kueue import (
    WorkloadWrite,
    admitted_condition,
    derive_gate,
    gated_pods,
    kueue_status,
    place_pods,
)
from elastrain_operator.policy.notices import move_noticed, notice_condition
from elastrain_operator.policy.progress import (
    ProgressReport,
    count_spares,
    derive_training_recovery,
    final_reports,
    member_reports,
    merge_progress,
)
from elastrain_operator.policy.replace import hung_condition, replace_planned_out, restart_if_hung
from elastrain_operator.policy.restarts import exhausted_budget
from elastrain_operator.policy.round import (
    Observed,
    Plan,
    Round,
    current_pods,
)
from elastrain_operator.policy.status import (
    TERMINAL,
    Accounting,
    EventSpec,
    Outcome,
    WorkerCounts,
    derive_status,
    fallback_events,
    find_condition,
    transition_events,
)
from elastrain_operator.policy.store import (
    StorePod,
    StoreReadiness,
    derive_store_readiness,
    store_timed_out,
    track_store,
)
from elastrain_operator.policy.ttl import deadline_exceeded, ttl_expired
from elastrain_operator.policy.validation import pod_config_problems, validate
from elastrain_operator.render.network import MetricsPeers

__all__ = ["Observed", "Plan", "StorePod", "current_pods", "plan"]


def _counts(job: TrainingJob, r: Round, observed: Observed, *, desired: int,
            pods: int) -> WorkerCounts:
    current = current_pods(r.acct.slots, observed.workers)
    # A moving slot's worker is its old pod until the replacement runs (policy.notices): the
    # world still trains with it, and a replacement that cannot be scheduled moves nothing.
    by_name = {p.name: p for p in observed.workers}
    for slot in r.acct.slots:
        old = by_name.get(slot.moving_from or "")
        new = current.get(slot.index)
        if old is not None and classify_pod_exit(old) is Exit.RUNNING and (
                new is None or classify_pod_exit(new) is not Exit.RUNNING):
            current[slot.index] = old
    active = [p for i, p in current.items() if i < pods]
    states = [classify_pod_exit(p) for p in active]
    pending = [p for p, s in zip(active, states, strict=True) if s is Exit.PENDING]
    ready = sum(p.ready for p, s in zip(active, states, strict=True) if s is Exit.RUNNING)
    return WorkerCounts(
        desired=desired,
        spares=pods - desired,
        running=sum(s is Exit.RUNNING for s in states),
        ready=ready,
        ready_spares=_ready_spares(job, observed, spares=pods - desired, ready=ready),
        pending=len(pending),
        unschedulable=next((p.unschedulable for p in pending if p.unschedulable), ""))


def _ready_spares(job: TrainingJob, observed: Observed, *, spares: int, ready: int) -> int:
    """Ready pods whose trainer said it waits as a spare. A round with a poll counts them (the
    trainers' batch rule may keep more than spec.spares out of the world). Between polls the
    ready workers of the last status keep their place: a ready pod lost is taken from the
    spares (a spare takes a lost worker's place at once), and a pod that became ready is no
    spare until a poll says so; so a round without a poll never flips what a poll wrote."""
    if not spares:
        return 0
    if observed.progress is not None:
        return min(count_spares(observed.progress), ready)
    old = job.status
    return min(old.ready_spares or 0, max(ready - old.ready_replicas, 0))


def _is_finishing(r: Round, observed: Observed, pods: int) -> bool:
    current = current_pods(r.acct.slots, observed.workers)
    return any(classify_pod_exit(p) is Exit.SUCCEEDED for i, p in current.items() if i < pods)


def _decide_terminal(job: TrainingJob, r: Round, counts: WorkerCounts, *, finishing: bool,
                     store: StoreReadiness, now: datetime) -> tuple[Phase, str, str] | None:
    if r.config_error:
        return ("Failed", c.CONFIGURATION_ERROR,
                f"configuration error in {r.config_error}; not restarted (no restart can fix "
                "it: correct the TrainingJob and create it again)")
    failed = [loss for loss in r.acct.losses if loss.kind == "Failed"]
    last = f"{failed[-1].pod}: {failed[-1].reason}" if failed else ""
    spent = exhausted_budget(job.spec.restart_policy, restarts=r.acct.restarts,
                             preemptions=r.acct.preemptions, last_failure=last)
    if spent is not None:
        return "Failed", *spent
    if not job.spec.suspend and deadline_exceeded(job, now):
        return ("Failed", c.DEADLINE_EXCEEDED,
                f"the job ran longer than spec.activeDeadlineSeconds "
                f"({job.spec.active_deadline_seconds})")
    if not finishing and (timed_out := store_timed_out(
            job.spec.rendezvous.store, r.acct.store, store, store_name(job.metadata.name),
            now=now)) is not None:
        return "Failed", *timed_out
    if finishing and counts.running == 0:
        return ("Succeeded", c.ALL_WORKERS_SUCCEEDED,
                "training finished: a worker exited 0 and no worker is running")
    return None


def _finish_warnings(observed: Observed) -> list[EventSpec]:
    """A Warning for each worker that ended 0 only because every node had finished training
    (its worker died after that: the launcher's warning line), once, as the job Succeeds."""
    return [EventSpec("Warning", c.WORKER_CRASHED_AFTER_FINISH,
                      f"{pod.name}: {warning} (the job Succeeded: training had finished)")
            for pod in sorted(observed.workers, key=lambda p: p.name)
            if (warning := finish_warning(pod))]


def _reports(observed: Observed) -> tuple[ProgressReport, ...] | None:
    """This round's polled reports plus the final ones finished workers left; None: neither."""
    final = final_reports(observed.workers)
    if observed.progress is None and not final:
        return None
    return (*(observed.progress or ()), *final)


def plan(job: TrainingJob, observed: Observed, *, now: datetime,
         network: MetricsPeers | None = None) -> Plan:
    """Everything one reconcile should do, in the order the shell applies it. `network`: the
    metrics port's peers when the operator gives each job its NetworkPolicy, else None."""
    old = job.status
    r = Round(acct=Accounting(
        slots=tuple(old.slots), losses=tuple(old.recent_losses), restarts=old.restarts,
        preemptions=old.preemptions, backoff_until=old.restart_backoff_until,
        recovering_since=old.recovering_since, store=old.rendezvous_store))
    if job.metadata.deletion_timestamp:
        # Being deleted: let the garbage collector take the pods; count and create nothing.
        return Plan(status=old, release_pods=tuple(p.name for p in observed.workers
                                                    if p.has_finalizer))
    blocking = tuple(validate(job)) + tuple(
        f"Service {s!r} exists and is not owned by this TrainingJob"
        for s in sorted(observed.foreign_services))
    terminal_already = old.phase in TERMINAL
    gate = derive_gate(job, observed.kueue) if observed.kueue is not None else None
    queued = gate is not None and not gate.runs  # Kueue holds the job: no pod may exist
    desired = 0 if job.spec.suspend or terminal_already or queued else job.spec.desired_workers
    if desired and gate is not None and gate.workers is not None:
        desired = max(min(desired, gate.workers), 1)  # partial admission: what was admitted
    pods = desired + job.spec.spares if desired else 0  # worker slots: workers + warm spares
    ensure_slots(r, pods)
    if (job.spec.suspend or queued) and not terminal_already:
        r.acct = replace(r.acct, store=None)  # the store is deleted; a resume starts anew
    elif desired:
        r.acct = replace(r.acct, store=track_store(r.acct.store, observed.store, now=now))
    store = derive_store_readiness(observed.store)
    finishing = _is_finishing(r, observed, pods)
    if not terminal_already:
        account(r, job, observed, pods=pods, counting=not (finishing or blocking), now=now)
    reports = _reports(observed)
    training = member_reports(reports)  # a waiting spare's report says nothing of training
    hung = None
    if not (terminal_already or finishing or blocking):
        if old.phase == "Running":
            hung = restart_if_hung(r, job, observed, training, pods=pods, now=now)
        if hung is None:
            replace_planned_out(r, job, observed, member_reports(observed.progress),
                                pods=pods, now=now)
            move_noticed(r, job, observed, member_reports(observed.progress), pods=pods)
    counts = _counts(job, r, observed, desired=desired, pods=pods)
    terminal = None if terminal_already else _decide_terminal(
        job, r, counts, finishing=finishing, store=store, now=now)
    created = in_backoff = False
    held = None
    if terminal_already or terminal is not None:
        finish(r, job, observed)
    else:
        cleanup_stale(r, observed, now)
        if not blocking:
            created, in_backoff, held = converge(r, job, observed, pods=pods,
                                                  finishing=finishing, network=network,
                                                  now=now)
    recovered = _recovery(r, observed, counts, now) if terminal is None else None
    if r.acct.backoff_until is not None and now >= r.acct.backoff_until:
        r.acct = replace(r.acct, backoff_until=None)
    problems = blocking + tuple(pod_config_problems(
        current_pods(r.acct.slots, observed.workers).values()))
    resumed = derive_training_recovery(old.last_recovery, r.acct.losses, training,
                                       mode=job.spec.recovery_mode)
    if gate is not None:
        r.create, placing = place_pods(r.create, job, gate)
        r.events.extend(placing)
    outcome = Outcome(problems=problems, blocked=bool(blocking), terminal=terminal,
                      created=created, queued=queued and not job.spec.suspend,
                      finishing=finishing, in_backoff=in_backoff,
                      progress=merge_progress(old.progress, old.last_checkpoint,
                                              training),
                      last_recovery=resumed or old.last_recovery,
                      fallback=newest_fallback(old.checkpoint_fallback,
                                               [rep.fallback for rep in reports or ()]),
                      store=None if terminal_already else store, store_hold=held)
    status = hung_condition(derive_status(job, counts, outcome, r.acct, now=now), job, hung,
                             training, now)
    status = notice_condition(status, r.acct.slots, observed, now=now,
                              generation=job.metadata.generation)
    create_workload, workload = None, WorkloadWrite()
    if gate is not None and observed.kueue is not None:
        status, create_workload, workload = kueue_status(
            status, job, observed.kueue, gate, observed.workers,
            store=observed.store is not None, ready_workers=counts.ready_workers,
            blocked=bool(blocking), now=now)
        if workload.event is not None:
            r.events.append(workload.event)
    elif gated := gated_pods(observed.workers):
        status = admitted_condition(status, None, gated, now=now,
                                    generation=job.metadata.generation)
    events = [*r.events, *transition_events(old, status), *fallback_events(old, status)]
    if terminal is not None and terminal[0] == "Succeeded":
        events.extend(_finish_warnings(observed))
    if (was := find_condition(old.conditions, c.HUNG)) and was.status == "True" and (
            now_hung := find_condition(status.conditions, c.HUNG)) and now_hung.status == "False":
        events.append(EventSpec("Normal", c.TRAINING_PROGRESSING, now_hung.message))
    if old.replicas and status.replicas and old.replicas != status.replicas:
        events.append(EventSpec("Normal", c.SCALED,
                                f"scaled from {old.replicas} to {status.replicas} workers"))
    if recovered is not None:
        events.append(EventSpec("Normal", c.RECOVERED,
                                f"back to {desired} workers {recovered:.1f}s after a loss"))
    if resumed is not None:
        events.append(_training_resumed(resumed))
    return Plan(status=status, create=tuple(r.create), delete_pods=tuple(r.delete_pods),
                force_delete_pods=tuple(r.force_delete_pods), release_pods=tuple(r.release_pods),
                delete_job=terminal_already and ttl_expired(job, now), events=tuple(events),
                counted_restarts=r.counted_restarts, counted_preemptions=r.counted_preemptions,
                recovered_after_seconds=recovered, training_recovery=resumed,
                hung=hung is not None, create_workload=create_workload, workload=workload)



def _training_resumed(rec: TrainingRecovery) -> EventSpec:
    start = ("from scratch" if rec.resumed_from_step is None
             else f"from step {rec.resumed_from_step}")
    how = " in process" if rec.mode == "InProcess" else ""
    return EventSpec("Normal", c.TRAINING_RESUMED,
                     f"training resumed{how} {start} {rec.seconds:.1f}s after {rec.pod} was lost")


def _recovery(r: Round, observed: Observed, counts: WorkerCounts,
              now: datetime) -> float | None:
    """Seconds from the first loss until every lost slot runs a worker again, or (warm spares)
    desired workers run again, when it just got there. Only the lost slots count: an extra
    worker that never got scheduled is reported as pending, and must not keep the job
    "restarting" forever. Without spares the second test implies the first; with them a spare
    takes a lost worker's place while the lost slot's replacement starts (the new spare)."""
    since = r.acct.recovering_since
    if since is None:
        return None
    if counts.desired == 0:
        r.acct = replace(r.acct, recovering_since=None)
        return None
    current = current_pods(r.acct.slots, observed.workers)
    pods = counts.desired + counts.spares
    lost = {loss.index for loss in r.acct.losses if loss.time >= since and loss.index < pods}
    back = counts.running >= counts.desired or all(
        i in current and classify_pod_exit(current[i]) is Exit.RUNNING for i in lost)
    if not back or r.counted_restarts or r.counted_preemptions:
        return None
    r.acct = replace(r.acct, recovering_since=None)
    return max(0.0, (now - since).total_seconds())
