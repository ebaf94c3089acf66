"""TrainingJob spec: what a user asks for.

Field names follow what users know from Kubeflow's PyTorchJob and JobSet (`minReplicas`,
`maxReplicas`, `ttlSecondsAfterFinished`, `activeDeadlineSeconds`, `suspend`), with units in
names. Limits are bounded so every CEL rule stays inside the apiserver's cost budget.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, model_validator

from elastrain_operator.model.base import ApiModel, cel, immutable, k8s
from elastrain_operator.model.names import MAX_JOB_NAME_LENGTH
from elastrain_operator.model.pod import (
    DNS_LABEL,
    EnvVar,
    LabelMap,
    PodTemplateOverride,
    Resources,
    Toleration,
)
from elastrain_operator.model.status import RecoveryMode, TrainingJobStatus
from elastrain_operator.model.trainer import (
    BATCH_MESSAGE,
    BATCH_RULE,
    BYTE_VOCAB_MESSAGE,
    TrainerSpec,
)

API_GROUP = "elastrain.dev"
API_VERSION = "v1alpha1"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ("tj",)
CATEGORIES = ("elastrain",)

# Upper bound for an elastic job without maxReplicas; also the CRD's bound on replica counts.
MAX_WORKERS = 1024

# The schemes the trainer image has a checkpoint backend for (the trainer's CHECKPOINT_SCHEMES):
# s3://<bucket> (S3 bucket naming rules), gs://<bucket> (GCS: also '_', dotted names up to 222),
# az:// or abfs://<container> (Azure: 3-63 of a-z, 0-9, '-'; abfs may name <container>@<account
# host>), each with an optional /<prefix>, or file://<path>. gs:// needs the Python package gcsfs
# and az:// and abfs:// need adlfs in the image; the trainer's start-up check names a missing one.
CHECKPOINT_URI = (r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
                  r"|gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]"
                  r"|(az|abfs)://[a-z0-9][a-z0-9-]{1,61}[a-z0-9](@[a-z0-9.-]+)?)(/.*)?$"
                  r"|^file://.+$")
CHECKPOINT_URI_MESSAGE = ("spec.checkpoint.uri must be s3://<bucket>[/<prefix>], "
                          "gs://<bucket>[/<prefix>] (the image needs gcsfs), "
                          "az://<container>[/<prefix>] or abfs://<container>[/<prefix>] "
                          "(the image needs adlfs), or file://<path>")

# Messages of rules the operator re-checks at reconcile time (policy.validation), so the two agree.
NAME_LENGTH_MESSAGE = (f"metadata.name must be at most {MAX_JOB_NAME_LENGTH} characters: "
                       "worker hostnames are <name>-worker-<index> (at most 63)")
NAME_DNS_LABEL_MESSAGE = ("metadata.name must start with a letter and contain no dots: "
                          "it names the job's Services")
GPU_REQUESTS_MESSAGE = ("spec.resources: a GPU's requests and limits must be equal (set one: "
                        "the operator sets the other)")
# In-process recovery runs the Session API of elastrain's own launcher (DDP, or FSDP2 resharded
# in process), on gloo (docs/recovery.md sections 10 and 13): what the trainer does not
# implement yet is refused here rather than found by a worker that exits at start. Several
# ranks per pod run in process when asked (a pod's ranks are one member of the world); an unset
# mode keeps such a job in Restart, the mode it got before they could, so that no running job
# changes protocol under an upgraded operator.
INPROCESS_COMMAND_MESSAGE = (
    "spec.recovery.mode InProcess needs elastrain's launcher: leave spec.command unset or name "
    "elastrain_trainer.launch in it (a stock torchrun script cannot regroup in process; use "
    "Restart)")
RANKS_DEFAULT_REASON = ("spec.nprocPerNode > 1 and spec.strategy hsdp run in process only "
                        "when asked (spec.recovery.mode InProcess)")
# GPU jobs run in process when asked, as an experiment (docs/recovery.md section 4): the NCCL
# abort and re-init path follows torch's documented API and has not run on a GPU in
# elastrain's tests. An unset mode keeps them in Restart.
GPU_DEFAULT_REASON = ("a GPU job runs in process only when asked (spec.recovery.mode "
                      "InProcess, experimental)")
INPROCESS_GPU_EXPERIMENTAL = (
    "in-process recovery on GPUs is experimental: NCCL's abort and re-init follow torch's "
    "documented API but have not run on a GPU in elastrain's tests; the protocol, DDP, FSDP2 "
    "and HSDP in process are verified on gloo (docs/recovery.md section 4)")
NCCL_ERROR_HANDLING_NAMES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
NCCL_ERROR_HANDLING_MESSAGE = (
    "spec.env TORCH_NCCL_ASYNC_ERROR_HANDLING (or NCCL_ASYNC_ERROR_HANDLING) must be 0 or 2 "
    "for a GPU job in spec.recovery.mode InProcess (unset: the trainer sets 2): 1 and 3 end the "
    "process when NCCL's watchdog sees a failed collective, so a survivor would die with its "
    "peer")
# Warm spares (docs/recovery.md section 9): the trainers, not the operator, decide who waits.
SPARES_MODE_MESSAGE = ("spec.spares needs spec.recovery.mode InProcess (in Restart mode "
                       "torchrun's rendezvous would add the spares to the world)")
DEFAULT_MODE_CHANGE_MESSAGE = (
    "spec.recovery.mode is unset, so the job's mode follows from spec.command, "
    "spec.nprocPerNode and GPU resources: this update would change the mode its workers run "
    "(InProcess where the job can run it, else Restart); keep them as they are, or create a "
    "new job with spec.recovery.mode set")
SPARES_METRICS_MESSAGE = ("spec.spares needs spec.metricsPort: the trainers learn the desired "
                          "world from the operator's /progress poll")
SPARES_BOUND_MESSAGE = (f"spec.spares: spec.maxReplicas (spec.replicas when unset) + spec.spares "
                        f"must be <= {MAX_WORKERS}: every spare is a worker pod")
NPROC_AUTO_MESSAGE = ("spec.nprocPerNode \"auto\" needs a GPU in spec.resources "
                      "(e.g. limits nvidia.com/gpu); set an integer for CPU workers")

# Rules on metadata.name live at the CRD's root, the one place CEL can see it. The apiserver
# already holds a custom resource's name to a DNS subdomain (lowercase alphanumerics, '-' and '.',
# alphanumeric at both ends); a Service name must also be a DNS-1035 label.
ROOT_RULES = k8s(
    cel(f"size(self.metadata.name) <= {MAX_JOB_NAME_LENGTH}", NAME_LENGTH_MESSAGE,
        field_path=".metadata.name"),
    cel("self.metadata.name.matches('^[a-z][^.]*$')", NAME_DNS_LABEL_MESSAGE,
        field_path=".metadata.name"),
)

ArgStr = Annotated[str, Field(max_length=4096)]


class SecretKeyRefs(ApiModel):
    """Where the object-store credentials live: a Secret in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_LABEL)
    access_key_id_key: str = Field(default="AWS_ACCESS_KEY_ID", max_length=253)
    secret_access_key_key: str = Field(default="AWS_SECRET_ACCESS_KEY", max_length=253)


class CheckpointSpec(ApiModel):
    """Where and how often the trainer saves sharded checkpoints."""

    uri: str = Field(
        max_length=1024,
        json_schema_extra=k8s(
            cel(f"self.matches('{CHECKPOINT_URI}')", CHECKPOINT_URI_MESSAGE),
            immutable("spec.checkpoint.uri"),
        ),
    )
    endpoint: str | None = Field(
        default=None, max_length=1024,
        json_schema_extra=k8s(cel("self.startsWith('http://') || self.startsWith('https://')",
                                  "spec.checkpoint.endpoint must be an http:// or https:// URL")),
    )
    region: str | None = Field(default=None, max_length=64)
    credentials_secret: SecretKeyRefs | None = None
    interval_steps: int = Field(default=0, ge=0, le=10_000_000)
    interval_seconds: int = Field(default=600, ge=0, le=604_800)
    keep: int = Field(default=3, ge=1, le=1000)
    async_: bool = Field(default=True, alias="async")
    resume: Literal["Latest", "Never"] = Field(
        default="Latest",
        description="Latest: resume from the newest committed checkpoint at the uri (a damaged "
                    "one is skipped and reported, a failing store is waited for). Never: start "
                    "from step 0 and, after a restart, resume only checkpoints this job wrote; "
                    "older ones stay until retention deletes them.")

    @model_validator(mode="after")
    def _uri_shape(self) -> CheckpointSpec:
        if not re.match(CHECKPOINT_URI, self.uri):
            raise ValueError(CHECKPOINT_URI_MESSAGE)
        return self


class RendezvousStore(ApiModel):
    """Placement of the job's rendezvous store pod: put it on a node that is not preempted."""

    image: str | None = Field(default=None, max_length=512)
    node_selector: LabelMap = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    priority_class_name: str | None = Field(default=None, max_length=253)
    ready_timeout_seconds: int = Field(
        default=600, ge=0, le=86_400,
        description="How long a store pod may stay never Ready (pulling, scheduling, "
                    "starting) before the job fails with RendezvousStoreNotReady; meanwhile "
                    "workers that lose the rendezvous to it are not counted as preemptions and "
                    "are replaced with backoff. Raise it for images that take long to pull; "
                    "0 waits forever.")


class RendezvousSpec(ApiModel):
    """c10d rendezvous settings; the store runs in a pod of its own, never inside a worker."""

    port: int = Field(default=29400, ge=1024, le=65535)
    join_timeout_seconds: int = Field(default=600, ge=1, le=86_400)
    last_call_timeout_seconds: int = Field(default=1, ge=0, le=3600)
    keep_alive_interval_seconds: int = Field(default=1, ge=1, le=600)
    keep_alive_max_attempts: int = Field(default=3, ge=1, le=100)
    store: RendezvousStore = Field(default_factory=RendezvousStore)


class RecoverySpec(ApiModel):
    """How the survivors of a lost worker go on (docs/recovery.md)."""

    mode: RecoveryMode | None = Field(
        default=None,
        description="Unset: InProcess where the job can run it (spec.command unset or naming "
                    "elastrain_trainer.launch, nprocPerNode unset or 1, no GPU), else Restart; "
                    "status.recoveryMode says which. "
                    "Restart: every worker restarts and resumes from the newest checkpoint "
                    "(torchrun's elastic rendezvous). InProcess: survivors keep their processes "
                    "and model state and regroup at the next step boundary; a replacement joins "
                    "with state from a live peer. InProcess needs the built-in trainer or a "
                    "script on the Session API, on CPU (gloo), a pod's nprocPerNode ranks joining "
                    "and leaving together; DDP, or FSDP2 "
                    "resharded in process (without notice FSDP2 restarts from the checkpoint).")
    heartbeat_timeout_seconds: int = Field(
        default=5, ge=2, le=300,
        description="A worker silent this long is judged lost (a pod that dies with its "
                    "node closes no socket): InProcess plans it out, Restart restarts the "
                    "group without it; 5 s is far below the node controller's 40 s and the "
                    "collective timeout's 5 minutes, and above a loaded node's pauses.")
    node_loss_toleration_seconds: int = Field(
        default=30, ge=0, le=3600,
        description="How long every pod of the job tolerates its node being NotReady or "
                    "unreachable (the node.kubernetes.io/not-ready and /unreachable NoExecute "
                    "taints) before it is evicted and replaced, in both modes; without it "
                    "Kubernetes gives 300 s. A toleration of the same key in the pod template "
                    "or the store's wins.")


class RestartPolicy(ApiModel):
    """Separate budgets: failures of the job's own making vs preemptions by the platform."""

    max_restarts: int = Field(default=3, ge=0, le=10_000)
    max_preemptions: int | None = Field(
        default=None, ge=0, le=1_000_000,
        description="Preemptions tolerated before the job fails; unset means unlimited.")
    backoff_seconds: int = Field(default=10, ge=0, le=3600)
    max_backoff_seconds: int = Field(default=300, ge=0, le=86_400)


def _gpu_in(resources: str, obj: str = "self") -> str:
    """CEL: spec.resources.<resources> names a GPU (nvidia.com/gpu, amd.com/gpu, ...)."""
    return (f"(has({obj}.resources.{resources}) && "
            f"{obj}.resources.{resources}.exists(k, k.endsWith('/gpu')))")


def _can_run(obj: str) -> str:
    """CEL: the job `obj` (self or oldSelf) can run in process (what an unset mode picks)."""
    return (f"((!has({obj}.command) || {obj}.command.exists(c, c == 'elastrain_trainer.launch'))"
            f" && {obj}.strategy != 'hsdp'"
            f" && (!has({obj}.nprocPerNode) || (type({obj}.nprocPerNode) == int && "
            f"{obj}.nprocPerNode == 1)) && !({_gpu_in('limits', obj)} || "
            f"{_gpu_in('requests', obj)}))")


_EXPLICIT_INPROCESS = "(has(self.recovery.mode) && self.recovery.mode == 'InProcess')"
_LAUNCHER_COMMAND = ("(!has(self.command) || "
                     "self.command.exists(c, c == 'elastrain_trainer.launch'))")
_NO_GPU = f"!({_gpu_in('limits')} || {_gpu_in('requests')})"

_SPEC_RULES = k8s(
    cel("self.minReplicas <= self.replicas",
        "spec.replicas must be >= spec.minReplicas", field_path=".replicas"),
    cel("!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
        "spec.replicas must be <= spec.maxReplicas", field_path=".replicas"),
    cel("!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
        "spec.minReplicas must be <= spec.maxReplicas", field_path=".minReplicas"),
    cel("has(self.maxReplicas) == has(oldSelf.maxReplicas)",
        "spec.maxReplicas is immutable: it cannot be added or removed after creation",
        field_path=".maxReplicas", reason="FieldValueForbidden"),
    cel("self.strategy == 'fsdp' || !self.trainer.cpuOffload",
        "spec.trainer.cpuOffload requires spec.strategy fsdp", field_path=".trainer.cpuOffload"),
    cel("!(self.trainer.dataset in ['synthetic', 'text']) || self.trainer.vocabSize >= 256",
        BYTE_VOCAB_MESSAGE, field_path=".trainer.vocabSize"),
    cel("self.trainer.minLr <= self.trainer.lr",
        "spec.trainer.minLr must be <= spec.trainer.lr", field_path=".trainer.minLr"),
    BATCH_RULE,
    cel("!has(self.command) || size(self.command) > 0",
        "spec.command must not be empty when set", field_path=".command"),
    cel("has(self.nprocPerNode) == has(oldSelf.nprocPerNode)",
        "spec.nprocPerNode is immutable: it cannot be added or removed after creation",
        field_path=".nprocPerNode", reason="FieldValueForbidden"),
    cel("!has(self.resources.limits) || !has(self.resources.requests) || "
        "self.resources.limits.all(k, !k.endsWith('/gpu') || !(k in self.resources.requests) "
        "|| string(self.resources.requests[k]) == string(self.resources.limits[k]))",
        GPU_REQUESTS_MESSAGE, field_path=".resources"),
    cel(f"!{_EXPLICIT_INPROCESS} || {_LAUNCHER_COMMAND}",
        INPROCESS_COMMAND_MESSAGE, field_path=".recovery.mode"),
    cel(f"!{_EXPLICIT_INPROCESS} || {_NO_GPU} || !has(self.env) || !self.env.exists(e, "
        f"e.name in {list(NCCL_ERROR_HANDLING_NAMES)} && has(e.value) && "
        "!(e.value in ['0', '2']))",
        NCCL_ERROR_HANDLING_MESSAGE, field_path=".env"),
    # Unset: the mode follows from fields that an update may change; the job keeps the one
    # it started with (its pods speak that protocol), so such an update is refused.
    cel(f"has(self.recovery.mode) || {_can_run('self')} == {_can_run('oldSelf')}",
        DEFAULT_MODE_CHANGE_MESSAGE, field_path=".recovery.mode"),
    cel("!has(self.nprocPerNode) || type(self.nprocPerNode) != string || "
        "self.nprocPerNode != 'auto' || "
        f"{_gpu_in('limits')} || {_gpu_in('requests')}",
        NPROC_AUTO_MESSAGE, field_path=".nprocPerNode"),
    cel(f"self.spares == 0 || (has(self.recovery.mode) ? "
        f"self.recovery.mode == 'InProcess' : {_can_run('self')})",
        SPARES_MODE_MESSAGE, field_path=".spares"),
    cel("self.spares == 0 || self.metricsPort != 0", SPARES_METRICS_MESSAGE,
        field_path=".spares"),
    cel(f"self.spares == 0 || (has(self.maxReplicas) ? self.maxReplicas : self.replicas) "
        f"+ self.spares <= {MAX_WORKERS}", SPARES_BOUND_MESSAGE, field_path=".spares"),
)


class TrainingJobSpec(ApiModel):
    """A desired elastic training job."""

    model_config = ApiModel.model_config | {"json_schema_extra": _SPEC_RULES}

    image: str = Field(min_length=1, max_length=512)
    command: list[ArgStr] | None = Field(
        default=None, max_length=64,
        description="Container command; unset runs the built-in trainer under torchrun.")
    args: list[ArgStr] = Field(default_factory=list, max_length=256)
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    replicas: int = Field(default=1, ge=1, le=MAX_WORKERS, description="Desired workers (pods).")
    min_replicas: int = Field(default=1, ge=1, le=MAX_WORKERS,
                              json_schema_extra=k8s(immutable("spec.minReplicas")))
    max_replicas: int | None = Field(
        default=None, ge=1, le=MAX_WORKERS,
        json_schema_extra=k8s(immutable("spec.maxReplicas")),
        description="Most workers the job may scale to; unset means no upper bound.")
    nproc_per_node: int | Literal["auto"] | None = Field(
        default=None,
        description="Processes (ranks) per worker pod. Default: the pod's GPU count "
                    "(resources nvidia.com/gpu), else 1.",
        json_schema_extra=k8s(
            cel("type(self) == string ? self == 'auto' : (self >= 1 && self <= 64)",
                "spec.nprocPerNode must be an integer in [1, 64] or \"auto\""),
            immutable("spec.nprocPerNode"),
            x_kubernetes_int_or_string=True,
        ),
    )
    resources: Resources = Field(default_factory=Resources)
    strategy: Literal["ddp", "fsdp", "hsdp"] = Field(
        default="ddp", description="ddp; fsdp (FSDP2 over every rank); hsdp (FSDP2 sharded "
        "over a pod's nprocPerNode ranks and replicated across pods)",
        json_schema_extra=k8s(immutable("spec.strategy")))
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    checkpoint: CheckpointSpec | None = None
    rendezvous: RendezvousSpec = Field(
        default_factory=RendezvousSpec, json_schema_extra=k8s(immutable("spec.rendezvous")))
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy)
    recovery: RecoverySpec = Field(
        default_factory=RecoverySpec, json_schema_extra=k8s(immutable("spec.recovery")))
    spares: int = Field(
        default=0, ge=0, le=MAX_WORKERS,
        description="InProcess: worker pods started ahead beyond spec.replicas. Each waits, "
                    "imports done and model built, to take a lost worker's place at the next "
                    "step boundary (its replacement becomes the new spare). Spares cost their "
                    "pods' resources all the time. Needs metricsPort. Default 0.")
    termination_grace_period_seconds: int = Field(default=120, ge=0, le=3600)
    template: PodTemplateOverride = Field(default_factory=PodTemplateOverride)
    metrics_port: int = Field(
        default=9400, ge=0, le=65535,
        description="Port of the trainer's /metrics and /progress; 0 turns progress polling off.")
    hang_timeout_seconds: int = Field(
        default=1800, ge=0, le=604_800,
        description="A job whose workers complete no training step for this long is hung: "
                    "told in a Hung condition and event, and its workers restarted as one "
                    "counted failure. 0 turns the watchdog off. Needs metricsPort.")
    suspend: bool = False
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=31_536_000)
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=31_536_000)

    @model_validator(mode="after")
    def _replica_bounds(self) -> TrainingJobSpec:
        # The same rules as the CRD's CEL, so objects built in Python fail the same way.
        if self.min_replicas > self.replicas:
            raise ValueError("spec.replicas must be >= spec.minReplicas")
        if self.max_replicas is not None and self.replicas > self.max_replicas:
            raise ValueError("spec.replicas must be <= spec.maxReplicas")
        global_batch, micro_batch = self.trainer.batch
        if global_batch % micro_batch:
            raise ValueError(BATCH_MESSAGE)
        if self.trainer.cpu_offload and self.strategy != "fsdp":
            raise ValueError("spec.trainer.cpuOffload requires spec.strategy fsdp")
        limits, requests = self.resources.limits, self.resources.requests
        if any(k.endswith("/gpu") and k in requests and str(requests[k]) != str(v)
               for k, v in limits.items()):
            raise ValueError(GPU_REQUESTS_MESSAGE)
        if self.trainer.min_lr > self.trainer.lr:
            raise ValueError("spec.trainer.minLr must be <= spec.trainer.lr")
        explicit = self.recovery.mode == "InProcess"
        if message := (explicit and self._inprocess_refusal()) or self._spares_refusal():
            raise ValueError(message)
        return self

    def _spares_refusal(self) -> str | None:
        if not self.spares:
            return None
        if not self.in_process:
            return SPARES_MODE_MESSAGE
        if not self.metrics_port:
            return SPARES_METRICS_MESSAGE
        if (self.max_replicas or self.replicas) + self.spares > MAX_WORKERS:
            return SPARES_BOUND_MESSAGE
        return None

    def _inprocess_refusal(self) -> str | None:
        """Why this job cannot run in process (None: it can)."""
        if self.command is not None and "elastrain_trainer.launch" not in self.command:
            return INPROCESS_COMMAND_MESSAGE
        if self.gpu_count and any(e.name in NCCL_ERROR_HANDLING_NAMES and e.value is not None
                                  and e.value not in ("0", "2") for e in self.env):
            return NCCL_ERROR_HANDLING_MESSAGE
        return None

    def _restart_by_default(self) -> str | None:
        """Why an unset mode is Restart for this job (None: it is InProcess)."""
        if refusal := self._inprocess_refusal():
            return refusal
        if self.gpu_count:
            return GPU_DEFAULT_REASON
        if ((self.nproc_per_node is not None and self.nproc_per_node != 1)
                or self.strategy == "hsdp"):
            return RANKS_DEFAULT_REASON
        return None

    @property
    def recovery_mode(self) -> RecoveryMode:
        """The mode the job runs: spec.recovery.mode, else InProcess where the job can run it
        (the survivors keep training), else Restart (docs/recovery.md section 13, point 15)."""
        if self.recovery.mode is not None:
            return self.recovery.mode
        return "Restart" if self._restart_by_default() else "InProcess"

    @property
    def in_process(self) -> bool:
        return self.recovery_mode == "InProcess"

    @property
    def experimental(self) -> str | None:
        """What of the job's mode is not verified (None: all of it is)."""
        return INPROCESS_GPU_EXPERIMENTAL if self.in_process and self.gpu_count else None

    @property
    def gpu_count(self) -> int:
        """GPUs per worker pod: its `<vendor>/gpu` limit, else request (whole devices)."""
        for table in (self.resources.limits, self.resources.requests):
            for key, value in table.items():
                if key.endswith("/gpu"):
                    try:
                        return int(str(value))
                    except ValueError:  # "1k" GPUs: a valid quantity, not a count we trust
                        return 1
        return 0

    @property
    def effective_nproc_per_node(self) -> int | Literal["auto"]:
        """What torchrun gets: nprocPerNode, else one process per GPU, else one."""
        if self.nproc_per_node is not None:
            return self.nproc_per_node
        return max(self.gpu_count, 1)

    @property
    def effective_max_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else MAX_WORKERS

    @property
    def desired_workers(self) -> int:
        """spec.replicas clamped to [minReplicas, maxReplicas]."""
        return max(self.min_replicas, min(self.replicas, self.effective_max_replicas))

    @property
    def worker_pods(self) -> int:
        """The worker pods the job keeps: the desired workers plus its warm spares."""
        return self.desired_workers + self.spares


class ObjectMeta(ApiModel):
    """The slice of metadata the operator reads."""

    model_config = ApiModel.model_config | {"extra": "ignore"}

    name: str = Field(max_length=63)
    namespace: str = "default"
    uid: str = ""
    generation: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None


class TrainingJob(ApiModel):
    """A whole TrainingJob object as read from the apiserver."""

    model_config = ApiModel.model_config | {"extra": "ignore"}

    api_version: str = f"{API_GROUP}/{API_VERSION}"
    kind: Literal["TrainingJob"] = "TrainingJob"
    metadata: ObjectMeta
    spec: TrainingJobSpec
    status: TrainingJobStatus = Field(default_factory=TrainingJobStatus)
