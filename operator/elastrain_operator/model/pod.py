"""The part of a worker pod a TrainingJob may set: its resources, environment and the narrow
PodSpec override (labels, scheduling, volumes, security), held to Pod Security's levels."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from elastrain_operator.model.base import ApiModel, cel, k8s
from elastrain_operator.model.pod_security import (
    NON_RESTRICTED_VOLUME_TYPES,
    ContainerSecurityContext,
    PodSecurityContext,
    PodSecurityLevel,
    refusals,
    template_rules,
)

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUANTITY = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
            r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")

LabelMap = Annotated[dict[str, Annotated[str, Field(max_length=63)]], Field(max_length=64)]
AnnotationMap = Annotated[dict[str, Annotated[str, Field(max_length=4096)]], Field(max_length=64)]
# An opaque Kubernetes object (affinity, a volume...) passed through to the pod as written;
# the apiserver validates it when the pod is created, so we do not embed PodSpec's schema.
Opaque = Annotated[
    dict[str, Any], Field(json_schema_extra=k8s(x_kubernetes_preserve_unknown_fields=True))]
Quantity = Annotated[
    int | str,
    Field(json_schema_extra=k8s(x_kubernetes_int_or_string=True, pattern=QUANTITY,
                                maxLength=64)),
]


class EnvVar(ApiModel):
    """A container environment variable, as in a PodSpec."""

    name: str = Field(min_length=1, max_length=256)
    value: str | None = Field(default=None, max_length=32768)
    value_from: Opaque | None = None


class Resources(ApiModel):
    """Per-worker compute resources, e.g. limits {"cpu": "2", "nvidia.com/gpu": 8}."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)


class Toleration(ApiModel):
    """A pod toleration (spot node pools are usually tainted)."""

    key: str | None = Field(default=None, max_length=253)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


# A pod volume: open (every volume source is kept as written), with the sources the template's
# Pod Security rules test for declared, since CEL sees only declared fields.
_SOURCE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
Volume = Annotated[dict[str, Any], Field(json_schema_extra={
    "properties": {"name": {"type": "string"},
                   **{k: _SOURCE for k in ("hostPath", *NON_RESTRICTED_VOLUME_TYPES)}},
    **k8s(x_kubernetes_preserve_unknown_fields=True)})]


# Worker pods carry volumes of the operator's own (render/security.py's scratch, render/control's
# token): a user's volume of the same name would make every pod creation fail.
RESERVED_VOLUME_PREFIX = "elastrain-"
RESERVED_VOLUMES_MESSAGE = (f"spec.template.volumes: a name starting with "
                            f"'{RESERVED_VOLUME_PREFIX}' is the operator's (its scratch and "
                            f"control-token volumes); rename the volume")
_RESERVED_VOLUMES_RULE = cel(
    f"!has(self.volumes) || self.volumes.all(v, !has(v.name) || "
    f"!v.name.startsWith('{RESERVED_VOLUME_PREFIX}'))",
    RESERVED_VOLUMES_MESSAGE, field_path=".volumes")


class PodTemplateOverride(ApiModel):
    """The narrow part of a PodSpec a user may set on worker pods."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": k8s(*template_rules(), _RESERVED_VOLUMES_RULE)}

    labels: LabelMap = Field(default_factory=dict)
    annotations: AnnotationMap = Field(default_factory=dict)
    node_selector: LabelMap = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    affinity: Opaque | None = None
    priority_class_name: str | None = Field(default=None, max_length=253)
    scheduler_name: str | None = Field(default=None, max_length=253)
    service_account_name: str | None = Field(default=None, max_length=253, pattern=DNS_LABEL)
    volumes: list[Volume] = Field(default_factory=list, max_length=32)
    volume_mounts: list[Opaque] = Field(default_factory=list, max_length=32)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[Annotated[str, Field(max_length=253)]] = Field(
        default_factory=list, max_length=8)
    pod_security: PodSecurityLevel = Field(
        default="Restricted",
        description="The Pod Security level the job's pods must pass. Restricted (the default) "
                    "refuses any setting below it; Baseline or Privileged allow the settings "
                    "that level allows, and admission warns with what was loosened.")
    pod_security_context: PodSecurityContext | None = None
    security_context: ContainerSecurityContext | None = None
    shm_size: Quantity | None = Field(
        default=None,
        description="Size of the memory-backed /dev/shm of each worker (DataLoader workers and "
                    "NCCL use it; it counts against the pod's memory). Default: 1Gi per local "
                    "process (nprocPerNode), 0 turns it off.")

    @model_validator(mode="after")
    def _pod_security(self) -> PodTemplateOverride:
        # The CRD's rules (model/pod_security.py), so objects built in Python fail the same way.
        problems = refusals(self)
        if any(str(v.get("name", "")).startswith(RESERVED_VOLUME_PREFIX) for v in self.volumes):
            problems.append(RESERVED_VOLUMES_MESSAGE)
        if problems:
            raise ValueError("; ".join(problems))
        return self
