"""Reading worker pods, and telling preemption from failure.

`classify_pod_exit` decides what a worker pod's state means for the job:

- Preempted: the platform took the worker away. Any `DisruptionTarget=True` condition (whatever
  its reason: PreemptionByScheduler, DeletionByTaintManager, EvictionByEvictionAPI,
  DeletionByPodGC, TerminationByKubelet, ...; the taint manager's eviction from a node that
  stopped answering is a failure: `evicted_from_lost_node`), a pod being deleted (the operator
  never deletes a pod of an active slot, so a deletion is someone else's: a drain, the pod GC
  after the node went away, a user), or a kubelet status reason that means the node dropped it
  (Evicted, NodeLost, Shutdown, Terminated, ...). This is checked first: a trainer that
  checkpoints on SIGTERM exits 143 or even 0, and must not look failed or finished. Also a
  worker whose torchrun agent lost the job's rendezvous store (its log, kept as the termination
  message, ends in RendezvousConnectionError): the store pod was deleted or its node lost, and
  every agent exits with it; the trainers have saved on the agent's SIGTERM, so this is the
  platform's loss too.
  Unless the store never worked: the planner asks policy.store whether the worker only ever
  knew a store that has never been Ready, and then counts it as neither.
- Failed: the trainer container ended non-zero on its own (exit 1, exit 137 OOMKilled, ...);
  among them the launcher's "worker crashed" exits, which quote the trainer's exception.
  A configuration error (configuration_error: the launcher's "elastrain: configuration error:
  <the trainer's message>" line, or a container whose command does not exist) is a Failed exit
  that no restart can fix: the planner fails the job on it at once.
- Succeeded: the pod Succeeded (torchrun exited 0: its whole worker group finished).
- Running / Pending: still going, or not started yet (`unschedulable` says why it waits).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from elastrain_operator.model.names import LABEL_ATTEMPT, LABEL_INDEX, TRAINER_CONTAINER

Manifest = dict[str, Any]

# pod.status.reason values a kubelet or node controller sets when it, not the trainer, ends a pod.
DISRUPTION_REASONS = frozenset({
    "Evicted", "NodeLost", "Preempting", "Shutdown", "NodeShutdown", "Terminated",
    "UnexpectedAdmissionError", "NodeAffinity", "OutOfcpu", "OutOfmemory", "OutOfpods",
})
# What torchrun's c10d rendezvous raises when the job's store stops answering (seen on a real node
# when the store pod was deleted: every agent exits 1 with it, from its keep-alive or its poll).
RENDEZVOUS_LOST = "RendezvousConnectionError"
# The DisruptionTarget reason of the node controller's NoExecute taint eviction.
TAINT_MANAGER = "DeletionByTaintManager"
# How the trainer's launcher starts the line that says why a worker crashed (the trainer's own
# exception): a crash counts against maxRestarts and its reason is quoted in events and status.
CRASH_PREFIX = "elastrain: worker crashed: "
# How the launcher starts the line of an error no restart can fix (an unreadable dataset, an
# invalid setting, a command that does not exist): the job fails at once, quoting the rest.
CONFIG_PREFIX = "elastrain: configuration error: "
# How the launcher starts the line of a pod that ended 0 despite a fault (its worker died after
# every node finished training): the job still Succeeds, and says so in a Warning event.
WARNING_PREFIX = "elastrain: warning: "
# The container runtime's terminated reasons when it could not start the command at all ...
_START_FAILURES = frozenset({"StartError", "ContainerCannotRun"})
# ... and the runtime's words for a command that is not there (containerd, CRI-O, Docker).
_NO_COMMAND = ("executable file not found", "no such file or directory")


class Exit(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    PREEMPTED = "Preempted"


@dataclass(frozen=True)
class WorkerPod:
    """The slice of a worker pod the planner reads."""

    name: str
    index: int
    attempt: int
    phase: str = "Pending"
    deleting: bool = False
    # When its graceful delete's grace period ends (deletionTimestamp); None while not deleting.
    deletion_deadline: datetime | None = None
    has_finalizer: bool = False
    ready: bool = False
    pod_ip: str = ""
    node: str = ""
    status_reason: str = ""
    disruption_reason: str = ""
    exit_code: int | None = None
    exit_reason: str = ""
    exit_message: str = ""  # the container's termination message (the log's tail on error)
    unschedulable: str = ""
    # spec.schedulingGates: a gate someone else put there (Kueue's pod integration) holds the
    # pod Pending, unscheduled, for as long as it stays.
    scheduling_gates: tuple[str, ...] = ()
    waiting_reason: str = ""
    waiting_message: str = ""
    created: str = ""
    # When the platform or the trainer ended it, as the pod says; None while it runs. A loss is
    # dated by this, not by when the operator counts it: an operator that restarts mid-recovery
    # counts late, and a recovery measured from then would miss a resume that came before.
    lost_at: datetime | None = None


def _condition(status: Manifest, kind: str) -> Manifest | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def _trainer_state(status: Manifest) -> tuple[Manifest, Manifest]:
    """(terminated, waiting) of the trainer container; empty when absent."""
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") == TRAINER_CONTAINER:
            state = cs.get("state") or {}
            last = cs.get("lastState") or {}
            return (dict(state.get("terminated") or last.get("terminated") or {}),
                    dict(state.get("waiting") or {}))
    return {}, {}


def read_worker_pod(pod: Manifest, finalizer: str) -> WorkerPod | None:
    """Parse a worker pod; None when its slot labels are missing or mangled (not ours to count)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        index, attempt = int(labels[LABEL_INDEX]), int(labels[LABEL_ATTEMPT])
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    disruption = _condition(status, "DisruptionTarget")
    ready = _condition(status, "Ready")
    scheduled = _condition(status, "PodScheduled")
    terminated, waiting = _trainer_state(status)
    return WorkerPod(
        name=str(meta.get("name", "")), index=index, attempt=attempt,
        phase=str(status.get("phase") or "Pending"),
        deleting=bool(meta.get("deletionTimestamp")),
        deletion_deadline=aware_time(meta.get("deletionTimestamp")),
        has_finalizer=finalizer in (meta.get("finalizers") or []),
        ready=bool(ready and ready.get("status") == "True"),
        pod_ip=str(status.get("podIP") or ""),
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        status_reason=str(status.get("reason") or ""),
        disruption_reason=(str(disruption.get("reason") or "DisruptionTarget")
                           if disruption and disruption.get("status") == "True" else ""),
        exit_code=terminated.get("exitCode"),
        exit_reason=str(terminated.get("reason") or ""),
        exit_message=str(terminated.get("message") or ""),
        unschedulable=(str(scheduled.get("message") or "Unschedulable")
                       if scheduled and scheduled.get("status") == "False" else ""),
        scheduling_gates=tuple(str(g.get("name", "")) for g in
                               (pod.get("spec") or {}).get("schedulingGates") or []),
        waiting_reason=str(waiting.get("reason") or ""),
        waiting_message=str(waiting.get("message") or ""),
        created=str(meta.get("creationTimestamp") or ""),
        lost_at=_lost_at(meta, disruption, terminated),
    )


def aware_time(value: Any) -> datetime | None:
    """An RFC 3339 time with its zone, as the apiserver and the trainers write them; None when
    absent, malformed or without a zone (it could not be compared with the operator's clock)."""
    try:
        parsed = datetime.fromisoformat(str(value)) if value else None
    except ValueError:
        return None
    return parsed if parsed is not None and parsed.tzinfo is not None else None


def answers_progress(pod: WorkerPod) -> bool:
    """Whether the worker can be asked for its progress: Ready, with an IP, not going away."""
    return pod.ready and bool(pod.pod_ip) and not pod.deleting


def _lost_at(meta: Manifest, disruption: Manifest | None,
             terminated: Manifest) -> datetime | None:
    """The earliest sign the pod was lost: the DisruptionTarget condition, the deletion request
    (deletionTimestamp is that plus the grace period), the trainer's exit."""
    times = []
    if disruption and disruption.get("status") == "True":
        times.append(aware_time(disruption.get("lastTransitionTime")))
    deleting = aware_time(meta.get("deletionTimestamp"))
    if deleting is not None:
        times.append(deleting - timedelta(seconds=int(meta.get("deletionGracePeriodSeconds") or 0)))
    times.append(aware_time(terminated.get("finishedAt")))
    known = [t for t in times if t is not None]
    return min(known) if known else None


def evicted_from_lost_node(pod: WorkerPod, lost_nodes: Mapping[str, str]) -> str | None:
    """Why the pod's node is lost, when the node controller's taint manager evicted the pod
    from it: a node that stopped answering (NotReady, unreachable) gave no notice, so its
    worker is a failure, as when the operator replaces it first (policy.replace), not a
    preemption. The eviction comes once the pod's node-loss toleration runs out, before the
    operator acts only when the operator was down meanwhile (its own node dark: e2e scenario
    3). Any other taint manager eviction (a NoExecute taint someone set) stays a preemption."""
    if pod.disruption_reason == TAINT_MANAGER and pod.node:
        return lost_nodes.get(pod.node)
    return None


def lost_rendezvous(pod: WorkerPod) -> bool:
    return pod.phase == "Failed" and RENDEZVOUS_LOST in pod.exit_message


def classify_pod_exit(pod: WorkerPod) -> Exit:
    if pod.disruption_reason or pod.deleting or pod.status_reason in DISRUPTION_REASONS:
        return Exit.PREEMPTED
    if lost_rendezvous(pod):
        return Exit.PREEMPTED
    if pod.phase == "Succeeded":
        return Exit.SUCCEEDED
    if pod.phase == "Failed":
        return Exit.FAILED
    if pod.phase == "Running":
        return Exit.RUNNING
    return Exit.PENDING


def describe_exit(pod: WorkerPod) -> str:
    """Why a lost worker counts as it does, for events and status messages."""
    if pod.disruption_reason:
        return f"DisruptionTarget: {pod.disruption_reason}"
    if pod.deleting:
        return "pod deleted"
    if pod.status_reason in DISRUPTION_REASONS:
        return f"pod {pod.status_reason}"
    if lost_rendezvous(pod):
        return f"rendezvous store lost ({RENDEZVOUS_LOST})"
    parts = [f"exit code {pod.exit_code}" if pod.exit_code is not None else "no exit code"]
    if pod.exit_reason:
        parts.append(pod.exit_reason)
    if config := configuration_error(pod):
        parts.append(f"configuration error: {config}")
    elif crash := crash_reason(pod.exit_message):
        parts.append(crash)
    return ", ".join(parts)


def configuration_error(pod: WorkerPod, limit: int = 400) -> str:
    """Why a failed worker cannot work however often it restarts ("" when it could): the
    launcher's configuration-error line (the trainer's message), or a command the container
    runtime could not find."""
    if pod.phase != "Failed":
        return ""
    lines = [ln.strip() for ln in pod.exit_message.splitlines()
             if ln.strip().startswith(CONFIG_PREFIX)]
    if lines:
        reason = lines[-1].removeprefix(CONFIG_PREFIX)
    elif pod.exit_reason in _START_FAILURES and any(
            words in pod.exit_message.lower() for words in _NO_COMMAND):
        reason = f"the container's command cannot start: {' '.join(pod.exit_message.split())}"
    else:
        return ""
    return reason if len(reason) <= limit else reason[:limit - 3] + "..."


def finish_warning(pod: WorkerPod, limit: int = 300) -> str:
    """The launcher's warning of a worker pod that Succeeded despite a fault ("" if none)."""
    if pod.phase != "Succeeded":
        return ""
    lines = [ln.strip() for ln in pod.exit_message.splitlines()
             if ln.strip().startswith(WARNING_PREFIX)]
    if not lines:
        return ""
    what = lines[-1].removeprefix(WARNING_PREFIX)
    return what if len(what) <= limit else what[:limit - 3] + "..."


def crash_reason(message: str, limit: int = 200) -> str:
    """The launcher's one-line reason for a crash of the trainer's own ("" if none): it ends
    the pod with `elastrain: worker crashed: rank R, exit code C: <exception>` in its
    termination message (elastrain_trainer.launch)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip().startswith(CRASH_PREFIX)]
    if not lines:
        return ""
    reason = lines[-1].removeprefix(CRASH_PREFIX)
    return reason if len(reason) <= limit else reason[:limit - 3] + "..."
