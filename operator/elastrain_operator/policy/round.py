"""One planning round's data: what the cluster has (Observed), what the round decides (Plan),
and its scratch (Round), shared by the planner (policy.planning) and the rules that replace
workers on their own evidence (policy.replace)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from elastrain_operator.model.status import TrainingJobStatus, TrainingRecovery, WorkerSlot
from elastrain_operator.policy.failures import WorkerPod
from elastrain_operator.policy.kueue import KueueView, WorkloadWrite
from elastrain_operator.policy.progress import ProgressReport
from elastrain_operator.policy.status import Accounting, EventSpec
from elastrain_operator.policy.store import StorePod
from elastrain_operator.render.meta import Manifest

MAX_RECENT_LOSSES = 10


@dataclass(frozen=True)
class Observed:
    """The job's children as the cluster has them now."""

    workers: tuple[WorkerPod, ...] = ()
    store: StorePod | None = None
    services: frozenset[str] = frozenset()          # owned by this job
    foreign_services: frozenset[str] = frozenset()  # our names, but someone else's objects
    # The job's NetworkPolicy exists: ours, or a user's of that name, which is left alone.
    network_policy: bool = False
    progress: tuple[ProgressReport, ...] | None = None  # None: not polled this round
    # Nodes that said they are about to go (policy.notices): node -> the signal; only the nodes
    # the job's workers run on, and empty where the operator reads no nodes.
    notices: Mapping[str, str] = field(default_factory=dict)
    notices_off: str = ""  # why the operator reads no notices though asked to (k8s.nodes)
    # Nodes that will not confirm their pods' end (policy.stale): node -> why; the job's
    # workers' nodes only, empty where the operator reads no nodes.
    lost_nodes: Mapping[str, str] = field(default_factory=dict)
    lost_since: Mapping[str, datetime] = field(default_factory=dict)  # node -> its loss began
    kueue: KueueView | None = None  # the job's Kueue Workload and queue; None: not queued


@dataclass(frozen=True)
class Plan:
    status: TrainingJobStatus
    create: tuple[Manifest, ...] = ()
    delete_pods: tuple[str, ...] = ()
    force_delete_pods: tuple[str, ...] = ()  # deleted with grace 0 (policy.stale)
    release_pods: tuple[str, ...] = ()
    delete_job: bool = False
    events: tuple[EventSpec, ...] = ()
    counted_restarts: int = 0
    counted_preemptions: int = 0
    recovered_after_seconds: float | None = None
    training_recovery: TrainingRecovery | None = None  # recorded this round (status.lastRecovery)
    hung: bool = False  # the progress watchdog restarted the workers this round
    create_workload: Manifest | None = None  # the job's Kueue Workload (render.workload)
    workload: WorkloadWrite = field(default_factory=WorkloadWrite)  # policy.kueue


@dataclass
class Round:
    """Mutable scratch of one planning round."""

    acct: Accounting
    events: list[EventSpec] = field(default_factory=list)
    create: list[Manifest] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    force_delete_pods: list[str] = field(default_factory=list)  # grace 0 (policy.stale)
    release_pods: list[str] = field(default_factory=list)
    counted_restarts: int = 0
    counted_preemptions: int = 0
    config_error: str = ""  # a worker's configuration error this round: the job fails


def current_pods(slots: Sequence[WorkerSlot], workers: Sequence[WorkerPod]) -> dict[int, WorkerPod]:
    """Slot index -> the pod of the slot's current attempt, where it exists."""
    attempt = {s.index: s.attempt for s in slots}
    return {p.index: p for p in workers if attempt.get(p.index, 0) == p.attempt}


