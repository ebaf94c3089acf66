"""`elastrain describe`: what kubectl does not already show about a TrainingJob.

Pure: the caller fetches the job and its pods (as API dicts) and prints the returned text.
Shows each worker slot with its pod, phase, node and attempt, the warm spares ready, the
rendezvous store (and why it is not Ready, from the RendezvousStoreReady condition), the
trainer's progress, last checkpoint
and checkpoint health, the newest resume that skipped a damaged checkpoint (what, why, from
which step training resumed, the steps lost), both budgets, the recent counted losses and how
long training took to run again after the newest of them, and where Kueue has the job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elastrain_operator.model import conditions as c
from elastrain_operator.model.names import LABEL_ROLE, ROLE_STORE, ROLE_WORKER, WORKER_FINALIZER
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import CheckpointHealth
from elastrain_operator.policy.failures import classify_pod_exit, describe_exit, read_worker_pod
from elastrain_operator.policy.fallback import describe_fallback

Manifest = dict[str, Any]
# RendezvousStoreReady reasons that need a person (starting, lost and replaced do not).
STORE_PROBLEMS = frozenset({c.STORE_IMAGE_PULL_FAILED, c.STORE_CRASH_LOOPING,
                            c.STORE_UNSCHEDULABLE, c.STORE_CONTAINER_FAILED})


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def _budget(used: int, limit: int | None) -> str:
    return f"{used}/{'unlimited' if limit is None else limit}"


def _header(job: TrainingJob) -> list[str]:
    s, spec = job.status, job.spec
    limit = "unbounded" if spec.max_replicas is None else str(spec.max_replicas)
    lines = [f"TrainingJob {job.metadata.namespace}/{job.metadata.name}: {s.phase}, "
             f"workers {s.workers or '0/0'} (min {spec.min_replicas}, max {limit})"]
    how = ("survivors keep training in their processes" if spec.in_process
           else "every worker restarts from the newest checkpoint")
    chosen = "" if spec.recovery.mode is not None else ", spec.recovery.mode unset"
    lines.append(f"Recovery: {spec.recovery_mode} ({how}{chosen})")
    if spec.experimental is not None:
        lines.append(f"Experimental: {spec.experimental}")
    if s.queue is not None:
        q = s.queue
        admitted = "" if q.admitted_workers is None else f", {q.admitted_workers} workers"
        lines.append(f"Kueue: {q.state} in LocalQueue {q.name} (Workload {q.workload}"
                     f"{admitted}): {q.message}")
    if spec.spares:
        lines.append(f"Spares: {s.ready_spares or 0} ready of {spec.spares} (warm: each takes a "
                     "lost worker's place at the next step)")
    if s.progress is not None:
        loss = "n/a" if s.progress.loss is None else f"{s.progress.loss:.4g}"
        world = "" if s.progress.world_size is None else f", world size {s.progress.world_size}"
        lines.append(f"Progress: step {s.progress.step}/{s.progress.total_steps}, "
                     f"loss {loss}{world}")
    if s.last_checkpoint is not None:
        when = s.last_checkpoint.time.isoformat() if s.last_checkpoint.time else "unknown time"
        lines.append(f"Last checkpoint: step {s.last_checkpoint.step} "
                     f"{s.last_checkpoint.uri} ({when})")
    if s.progress is not None and s.progress.checkpoint_health is not None:
        lines.append(_checkpoint_health(s.progress.checkpoint_health))
    if s.checkpoint_fallback is not None:
        lines.append(f"Checkpoint fallback: {describe_fallback(s.checkpoint_fallback)}")
    budgets = (f"Restarts {_budget(s.restarts, spec.restart_policy.max_restarts)}, "
               f"preemptions {_budget(s.preemptions, spec.restart_policy.max_preemptions)}")
    if s.restart_backoff_until is not None:
        budgets += f", next failed-worker replacement after {s.restart_backoff_until.isoformat()}"
    lines.append(budgets)
    return lines


def _checkpoint_health(health: CheckpointHealth) -> str:
    when = (f" at {health.last_failure_time.isoformat()}" if health.last_failure_time
            else "")
    if health.consecutive_failures:
        return (f"Checkpoint saves: FAILING, {health.consecutive_failures} in a row, the latest"
                f"{when}: {health.last_error}")
    if health.last_error:
        return f"Checkpoint saves: healthy (the last failure{when}: {health.last_error})"
    return "Checkpoint saves: healthy"


def _workers(pods: Sequence[Manifest]) -> list[str]:
    rows = [["INDEX", "POD", "PHASE", "READY", "NODE", "ATTEMPT", "STATE"]]
    parsed = [w for p in pods if (p.get("metadata") or {}).get("labels", {}).get(LABEL_ROLE)
              == ROLE_WORKER and (w := read_worker_pod(p, WORKER_FINALIZER)) is not None]
    for w in sorted(parsed, key=lambda w: (w.index, w.attempt)):
        state = classify_pod_exit(w).value
        if state in ("Failed", "Preempted"):
            state += f" ({describe_exit(w)})"
        elif w.unschedulable:
            state += f" (unschedulable: {w.unschedulable})"
        elif w.waiting_reason:
            state += f" ({w.waiting_reason})"
        if w.deleting:
            state += ", terminating"
        rows.append([str(w.index), w.name, w.phase, "yes" if w.ready else "no",
                     w.node or "-", str(w.attempt), state])
    return ["Workers:", *(_table(rows) if len(rows) > 1 else ["  none"])]


def _store(job: TrainingJob, pods: Sequence[Manifest]) -> list[str]:
    stores = [p for p in pods
              if (p.get("metadata") or {}).get("labels", {}).get(LABEL_ROLE) == ROLE_STORE]
    cond = next((x for x in job.status.conditions if x.type == c.RENDEZVOUS_STORE_READY), None)
    why = "" if cond is None or cond.status == "True" else f": not Ready, {cond.reason}: " \
        f"{cond.message}"
    lost = job.status.rendezvous_store.workers_lost if job.status.rendezvous_store else 0
    if lost:
        why += f" ({lost} worker(s) lost to it, not counted)"
    if not stores:
        return [f"Rendezvous store: none{why}"]
    p = stores[0]
    node = (p.get("spec") or {}).get("nodeName") or "unscheduled"
    phase = (p.get("status") or {}).get("phase") or "Pending"
    return [f"Rendezvous store: {p['metadata']['name']} {phase} on {node}{why}"]


def _losses(job: TrainingJob) -> list[str]:
    if not job.status.recent_losses:
        return []
    lines = ["Recent losses:"]
    for loss in reversed(job.status.recent_losses):
        lines.append(f"  {loss.time.isoformat()}  worker {loss.index}  {loss.pod}  "
                     f"{loss.kind}: {loss.reason}")
    return lines


def _last_recovery(job: TrainingJob) -> list[str]:
    rec = job.status.last_recovery
    if rec is None:
        return []
    start = "scratch" if rec.resumed_from_step is None else f"step {rec.resumed_from_step}"
    how = " in process" if rec.mode == "InProcess" else ""
    return [f"Last recovery: training resumed{how} from {start} {rec.seconds:.1f}s after "
            f"{rec.pod} was lost ({rec.kind} at {rec.lost_at.isoformat()}, training again at "
            f"{rec.training_at.isoformat()})"]


def _problems(job: TrainingJob) -> list[str]:
    """Conditions that say something is wrong (kubectl shows them, but buried in YAML)."""
    bad = [x for x in job.status.conditions
           if (x.type == "Valid" and x.status == "False")
           or (x.type in ("Failed", "Restarting", "CheckpointsFailing") and x.status == "True")
           or (x.type == "RendezvousStoreReady" and x.status == "False"
               and x.reason in STORE_PROBLEMS)
           or (x.type == "AllWorkersRunning" and x.status == "False"
               and x.reason not in ("JobSuspended", "JobTerminated"))]
    return [f"{x.type}={x.status} {x.reason}: {x.message}" for x in bad]


def describe_job(job: Manifest | TrainingJob, pods: Sequence[Manifest]) -> str:
    """A human summary of a TrainingJob and its pods."""
    parsed = job if isinstance(job, TrainingJob) else TrainingJob.model_validate(job)
    lines = [*_header(parsed), *_store(parsed, pods), *_workers(pods), *_losses(parsed),
             *_last_recovery(parsed)]
    if problems := _problems(parsed):
        lines += ["Attention:", *(f"  {p}" for p in problems)]
    return "\n".join(lines) + "\n"
