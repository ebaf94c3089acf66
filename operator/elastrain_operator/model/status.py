"""TrainingJob status: what the operator observed and the trainer reported.

Everything the operator writes is declared here: a structural status schema silently prunes
undeclared fields. kopf keeps its own progress in annotations, not in status.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, Field

from elastrain_operator.model.base import ApiModel, k8s

Phase = Literal["Pending", "Queued", "Running", "Restarting", "Suspended", "Succeeded",
                "Failed"]
ConditionStatus = Literal["True", "False", "Unknown"]
# The patterns metav1.Condition declares.
CONDITION_TYPE = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$")
CONDITION_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class Condition(ApiModel):
    """A metav1.Condition."""

    type: str = Field(max_length=316, pattern=CONDITION_TYPE)
    status: ConditionStatus
    reason: str = Field(min_length=1, max_length=1024, pattern=CONDITION_REASON)
    message: str = Field(default="", max_length=32768)
    last_transition_time: datetime
    observed_generation: int = Field(default=0, ge=0)


class CheckpointRef(ApiModel):
    """The newest committed checkpoint the trainer reported."""

    step: int = Field(ge=0)
    uri: str = Field(default="", max_length=2048)
    time: datetime | None = None


class CheckpointHealth(ApiModel):
    """How the trainers' checkpoint saves are going (reported in /progress)."""

    consecutive_failures: int = Field(
        default=0, ge=0, description="Checkpoint saves (or start-up checks of the location) that "
                                     "failed since the last one that succeeded.")
    last_error: str = Field(default="", max_length=1024,
                            description="What the latest failure was, where and with which "
                                        "credentials (kept after a recovery).")
    last_failure_time: AwareDatetime | None = None


class CheckpointFallback(ApiModel):
    """A resume that skipped a checkpoint proven damaged and loaded an older one (or none)."""

    skipped_step: int = Field(ge=0, description="The newest committed checkpoint, skipped.")
    skipped_uri: str = Field(default="", max_length=2048)
    reason: str = Field(default="", max_length=600,
                        description="Why it was skipped (the proof of damage).")
    loaded_step: int | None = Field(
        default=None, ge=0, description="The step training resumed from; absent: from step 0.")
    loaded_uri: str | None = Field(default=None, max_length=2048)
    steps_lost: int = Field(default=0, ge=0, description="skippedStep - loadedStep (or 0).")
    quarantined: bool = Field(
        default=False, description="The damaged checkpoint is kept, never loaded again.")
    time: AwareDatetime = Field(description="When the trainer decided it (trainer's clock).")


class ValidationLoss(ApiModel):
    """The trainers' latest loss on the validation split (spec.trainer.validation)."""

    step: int = Field(ge=0, description="The step after which it was evaluated.")
    loss: float = Field(description="Mean loss over every rank's share of the batches.")


class Progress(ApiModel):
    """Training progress reported by the trainer."""

    step: int = Field(default=0, ge=0)
    total_steps: int = Field(default=0, ge=0)
    loss: float | None = None
    world_size: int | None = Field(default=None, ge=0)
    resumed_from_step: int | None = Field(
        default=None, ge=0, description="The step the trainers' latest resume loaded.")
    training_since: AwareDatetime | None = Field(
        default=None, description="When the first step after the trainers' latest start ended.")
    last_step_time: AwareDatetime | None = Field(
        default=None, description="When the latest training step ended (trainer's clock).")
    checkpoint_health: CheckpointHealth | None = Field(
        default=None, description="Checkpoint saves as the trainers see them (policy/checkpoints).")
    validation: ValidationLoss | None = Field(
        default=None, description="The latest validation loss; kept across restarts until a "
                                  "newer evaluation.")


class WorkerSlot(ApiModel):
    """Bookkeeping of one worker index; how each lost pod is counted exactly once.

    Worker pods carry their slot's `attempt` in a label. A pod whose attempt is below its slot's
    has been accounted for (counted, retired by a scale-down or a suspend) and is only cleaned up.
    The operator raises an attempt in the same status write that counts the loss, before it
    touches any pod, so a restart between the two steps neither misses nor repeats a count.
    """

    index: int = Field(ge=0)
    attempt: int = Field(default=0, ge=0)
    replace_after: datetime | None = Field(
        default=None, description="A failed worker's replacement waits until then (backoff).")
    moving_from: str | None = Field(
        default=None, max_length=253,
        description="The slot's previous pod, on a node that gave notice: it trains on until "
                    "this attempt's pod joined the world, then leaves (policy.notices).")


class WorkerLoss(ApiModel):
    """One counted loss of a worker pod (the newest few are kept for `elastrain describe`)."""

    index: int = Field(ge=0)
    pod: str = Field(max_length=253)
    kind: Literal["Preempted", "Failed"]
    reason: str = Field(default="", max_length=256)
    exit_code: int | None = None
    time: datetime


class RendezvousStoreState(ApiModel):
    """The job's current rendezvous store pod as the operator has seen it (policy/store): a
    worker that lost the rendezvous while this store was never Ready is the store's loss."""

    uid: str = Field(default="", max_length=128, description="The store pod's uid.")
    created: datetime = Field(description="When the store pod was created.")
    ready_at: datetime | None = Field(
        default=None, description="When it was first seen Ready; absent: never Ready yet.")
    workers_lost: int = Field(
        default=0, ge=0, description="Workers lost to it while it was never Ready (not counted "
                                     "as preemptions; they pace the replacements).")
    replace_after: datetime | None = Field(
        default=None, description="Workers are replaced after this time (backoff), or as soon "
                                  "as the store is Ready.")
    unheard_on: str | None = Field(
        default=None, max_length=253,
        description="The node of this store pod, replaced because no trainer heard it (its "
                    "node dark, its process frozen): the next store pod prefers another node.")


QueueState = Literal["Creating", "Queued", "Admitted", "Evicted", "Finished"]


class QueueStatus(ApiModel):
    """Where Kueue has the job (policy.kueue): its LocalQueue, its Workload and why it waits."""

    name: str = Field(max_length=253, description="The LocalQueue (kueue.x-k8s.io/queue-name, "
                                                  "or the namespace's LocalQueue `default`).")
    workload: str = Field(default="", max_length=253, description="The job's Kueue Workload.")
    state: QueueState = Field(
        default="Creating",
        description="Creating (the Workload is being made), Queued (no quota yet, or requeued "
                    "after an eviction), Admitted (pods run within the quota), Evicted (Kueue "
                    "took the quota back: the workers save and stop, then it is released), "
                    "Finished.")
    cluster_queue: str = Field(default="", max_length=253,
                               description="The ClusterQueue that admitted it.")
    admitted_workers: int | None = Field(
        default=None, ge=0, description="Workers the job runs under Kueue: what its admission "
                                        "covers (partial admission can give fewer than "
                                        "spec.replicas, never below minReplicas) less "
                                        "yieldedWorkers, plus those its extra Workload's "
                                        "admission adds.")
    yielded_workers: int = Field(
        default=0, ge=0, description="Workers given back during this admission to a waiting "
                                     "Workload of a higher priority that Kueue would not "
                                     "preempt for (the Workload's status.reclaimablePods); "
                                     "they come back through the job's extra Workload or "
                                     "with the next admission.")
    yielded_at: datetime | None = Field(default=None, description="When workers were last "
                                                                  "given back.")
    message: str = Field(default="", max_length=2048, description="Kueue's word on it.")


RecoveryMode = Literal["Restart", "InProcess"]


class TrainingRecovery(ApiModel):
    """How long training took to run again after the newest counted worker loss."""

    lost_at: datetime = Field(description="When the loss was counted.")
    training_at: datetime = Field(
        description="When the first training step after the resume ended (trainer's clock).")
    seconds: float = Field(ge=0, description="trainingAt - lostAt.")
    kind: Literal["Preempted", "Failed"]
    pod: str = Field(default="", max_length=253, description="The lost worker pod.")
    resumed_from_step: int | None = Field(
        default=None, ge=0, description="The step training resumed from: a checkpoint's "
                                         "(Restart), the survivors' (InProcess).")
    mode: RecoveryMode = Field(
        default="Restart", description="The job's spec.recovery.mode when the loss recovered.")


class TrainingJobStatus(ApiModel):
    """Observed state of a TrainingJob."""

    model_config = ApiModel.model_config | {"extra": "ignore"}

    phase: Phase = "Pending"
    conditions: list[Condition] = Field(
        default_factory=list, max_length=32,
        json_schema_extra=k8s(x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["type"]))
    replicas: int = Field(default=0, ge=0, description="Desired workers right now.")
    ready_replicas: int = Field(
        default=0, ge=0, description="Workers whose pod is Ready (ready spares not included).")
    workers: str = Field(default="", max_length=32,
                         description="Ready/desired workers, e.g. 3/4 (a printer column).")
    ready_spares: int | None = Field(
        default=None, ge=0,
        description="Ready pods whose trainer waits as a spare (spec.spares), as the latest "
                    "progress poll found them; not in readyReplicas. Absent without spares.")
    recovery_mode: RecoveryMode | None = Field(
        default=None, description="How the job recovers a lost worker: spec.recovery.mode, or "
                                  "what an unset mode picked for this job.")
    pending_replicas: int = Field(
        default=0, ge=0, description="Workers created but not scheduled or started.")
    selector: str = Field(
        default="", max_length=1024,
        description="Serialized label selector of the workers (scale subresource).")
    restarts: int = Field(default=0, ge=0,
                          description="Worker failures counted against maxRestarts.")
    preemptions: int = Field(default=0, ge=0,
                             description="Workers lost to preemption or disruption.")
    restart_backoff_until: datetime | None = Field(
        default=None, description="No failed worker is replaced before this time.")
    last_checkpoint: CheckpointRef | None = None
    progress: Progress | None = None
    slots: list[WorkerSlot] = Field(
        default_factory=list, max_length=1024,
        json_schema_extra=k8s(x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["index"]),
        description="Per-worker-index attempts: how lost pods are counted exactly once.")
    recent_losses: list[WorkerLoss] = Field(
        default_factory=list, max_length=10, description="The newest counted worker losses.")
    recovering_since: datetime | None = Field(
        default=None, description="When a worker was lost and the job fell below its size.")
    last_recovery: TrainingRecovery | None = Field(
        default=None, description="Worker lost -> first training step after the resume.")
    checkpoint_fallback: CheckpointFallback | None = Field(
        default=None, description="The newest resume that skipped a damaged checkpoint "
                                  "(policy/fallback); kept after later normal resumes.")
    rendezvous_store: RendezvousStoreState | None = Field(
        default=None, description="The rendezvous store pod the workers depend on "
                                  "(see the RendezvousStoreReady condition).")
    queue: QueueStatus | None = Field(
        default=None, description="Kueue's admission of the job; absent when Kueue does not "
                                  "queue it.")
    start_time: datetime | None = None
    completion_time: datetime | None = None
    observed_generation: int = Field(default=0, ge=0)
