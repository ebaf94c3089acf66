"""What a job's pods run as: the restricted Pod Security level by default, looser only on request.

Platform teams enforce Pod Security `restricted` (or Kyverno/Gatekeeper policies that say the
same) where ML jobs run, so every pod the operator renders passes it with no input
(render/security.py). A job may set the few fields a real job needs (a user id, an fsGroup for a
volume, a Localhost seccomp profile). A setting below `restricted` is refused at admission,
naming the field and the level it needs, unless `spec.template.podSecurity` names that level;
then the chart's ValidatingAdmissionPolicy warns with what was loosened (render/admission.py),
so the choice is explicit and visible in `kubectl apply`'s output.

`LOOSENINGS` is the one table both checks come from: each entry is the CEL test the CRD and the
admission policy run, and the same test in Python for objects built here (`elastrain validate`,
the operator), with one message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from elastrain_operator.model.base import ApiModel, cel, k8s

PodSecurityLevel = Literal["Restricted", "Baseline", "Privileged"]

# The user and group the images run as (trainer_image/Dockerfile, the chart's operator pod).
DEFAULT_USER = 65532

# Pod Security Standards (v1.34): the volume types `restricted` allows, and the capabilities
# `baseline` allows a container to add (`restricted` allows NET_BIND_SERVICE alone).
RESTRICTED_VOLUME_TYPES = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                           "persistentVolumeClaim", "projected", "secret")
BASELINE_CAPABILITIES = ("AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT")
RESTRICTED_CAPABILITIES = ("NET_BIND_SERVICE",)
# The volume sources `baseline` allows and `restricted` does not (core/v1 VolumeSource), named so
# that CEL can test for each; hostPath needs Privileged.
NON_RESTRICTED_VOLUME_TYPES = (
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "fc", "flexVolume",
    "flocker", "gcePersistentDisk", "gitRepo", "glusterfs", "iscsi", "nfs",
    "photonPersistentDisk", "portworxVolume", "quobyte", "rbd", "scaleIO", "storageos",
    "vsphereVolume")

_ID = Field(default=None, ge=0, le=2_147_483_647)


class SeccompProfile(ApiModel):
    """The pods' seccomp profile: RuntimeDefault unless set; Unconfined needs Privileged."""

    model_config = ApiModel.model_config | {"json_schema_extra": k8s(cel(
        "self.type == 'Localhost' ? has(self.localhostProfile) : !has(self.localhostProfile)",
        "spec.template.podSecurityContext.seccompProfile.localhostProfile is required with "
        "type Localhost and only then"))}

    type: Literal["RuntimeDefault", "Localhost", "Unconfined"]
    localhost_profile: str | None = Field(default=None, min_length=1, max_length=253)


class PodSecurityContext(ApiModel):
    """Pod-level settings a job may change; unset ones keep the restricted defaults
    (runAsNonRoot, user and group 65532, seccomp RuntimeDefault)."""

    run_as_user: int | None = _ID
    run_as_group: int | None = _ID
    run_as_non_root: bool | None = None
    fs_group: int | None = _ID
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] | None = None
    supplemental_groups: list[int] = Field(default_factory=list, max_length=32)
    seccomp_profile: SeccompProfile | None = None


class Capabilities(ApiModel):
    """Capabilities added to the trainer container; ALL others are always dropped."""

    add: list[str] = Field(default_factory=list, max_length=16,
                           json_schema_extra=k8s(x_kubernetes_list_type="set"))


class ContainerSecurityContext(ApiModel):
    """Trainer-container settings a job may change; unset ones keep the restricted defaults
    (no privilege escalation, capabilities drop ALL, read-only root filesystem)."""

    read_only_root_filesystem: bool | None = Field(
        default=None, description="false gives the container a writable root filesystem "
                                  "(not below restricted; /tmp is always writable).")
    allow_privilege_escalation: bool | None = None
    privileged: bool | None = None
    capabilities: Capabilities | None = None


@dataclass(frozen=True)
class Loosening:
    """A setting below `restricted`: where it is, the level it needs, and how to see it."""

    field: str            # as a user writes it, under spec.template
    needs: PodSecurityLevel
    what: str             # what the pods lose, for the admission warning
    cel: str              # true when the template (`{t}`) has the setting
    present: Callable[[Any], bool]  # the same test on a PodTemplateOverride


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


_PSC = "has({t}.podSecurityContext)"
_SC = "has({t}.securityContext)"
_CAPS = f"{_SC} && has({{t}}.securityContext.capabilities)"


def _adds(t: Any) -> list[str]:
    sc = t.security_context
    return list(sc.capabilities.add) if sc and sc.capabilities else []


LOOSENINGS: tuple[Loosening, ...] = (
    Loosening(
        "podSecurityContext.runAsNonRoot", "Baseline", "run as root (runAsNonRoot: false)",
        f"{_PSC} && has({{t}}.podSecurityContext.runAsNonRoot) && "
        "!{t}.podSecurityContext.runAsNonRoot",
        lambda t: bool(t.pod_security_context) and t.pod_security_context.run_as_non_root is False),
    Loosening(
        "podSecurityContext.runAsUser", "Baseline", "run as root (runAsUser: 0)",
        f"{_PSC} && has({{t}}.podSecurityContext.runAsUser) && "
        "{t}.podSecurityContext.runAsUser == 0",
        lambda t: bool(t.pod_security_context) and t.pod_security_context.run_as_user == 0),
    Loosening(
        "podSecurityContext.seccompProfile", "Privileged", "run without seccomp (Unconfined)",
        f"{_PSC} && has({{t}}.podSecurityContext.seccompProfile) && "
        "{t}.podSecurityContext.seccompProfile.type == 'Unconfined'",
        lambda t: bool(t.pod_security_context and t.pod_security_context.seccomp_profile)
        and t.pod_security_context.seccomp_profile.type == "Unconfined"),
    Loosening(
        "securityContext.allowPrivilegeEscalation", "Baseline",
        "gain privileges (allowPrivilegeEscalation: true)",
        f"{_SC} && has({{t}}.securityContext.allowPrivilegeEscalation) && "
        "{t}.securityContext.allowPrivilegeEscalation",
        lambda t: bool(t.security_context)
        and t.security_context.allow_privilege_escalation is True),
    Loosening(
        "securityContext.privileged", "Privileged", "run privileged",
        f"{_SC} && has({{t}}.securityContext.privileged) && {{t}}.securityContext.privileged",
        lambda t: bool(t.security_context) and t.security_context.privileged is True),
    Loosening(
        "securityContext.capabilities.add", "Baseline",
        "add capabilities beyond NET_BIND_SERVICE",
        f"{_CAPS} && {{t}}.securityContext.capabilities.add.exists(c, !(c in "
        f"{_cel_list(RESTRICTED_CAPABILITIES)}) && c in {_cel_list(BASELINE_CAPABILITIES)})",
        lambda t: any(c not in RESTRICTED_CAPABILITIES and c in BASELINE_CAPABILITIES
                      for c in _adds(t))),
    Loosening(
        "securityContext.capabilities.add", "Privileged",
        "add capabilities beyond Pod Security baseline's list",
        f"{_CAPS} && {{t}}.securityContext.capabilities.add.exists(c, !(c in "
        f"{_cel_list(BASELINE_CAPABILITIES)}))",
        lambda t: any(c not in BASELINE_CAPABILITIES for c in _adds(t))),
    Loosening(
        "volumes", "Baseline",
        f"mount volume types other than {', '.join(RESTRICTED_VOLUME_TYPES)}",
        "has({t}.volumes) && {t}.volumes.exists(v, "
        + " || ".join(f"has(v.{k})" for k in NON_RESTRICTED_VOLUME_TYPES) + ")",
        lambda t: any(k in NON_RESTRICTED_VOLUME_TYPES for v in t.volumes for k in v)),
    Loosening(
        "volumes", "Privileged", "mount a hostPath volume",
        "has({t}.volumes) && {t}.volumes.exists(v, has(v.hostPath))",
        lambda t: any("hostPath" in v for v in t.volumes)),
)

_ALLOWS = {"Restricted": ("Restricted", "Baseline", "Privileged"),
           "Baseline": ("Baseline", "Privileged"), "Privileged": ("Privileged",)}


def refusal_message(loosening: Loosening) -> str:
    return (f"spec.template.{loosening.field}: the pods would {loosening.what}, below the "
            f"restricted Pod Security level; set spec.template.podSecurity: {loosening.needs} "
            "to allow it")


def template_rules() -> list[dict[str, str]]:
    """The CRD's CEL rules on spec.template: each loosening needs its level named."""
    rules = []
    for loosening in LOOSENINGS:
        level = "(has(self.podSecurity) ? self.podSecurity : 'Restricted')"
        allowed = " || ".join(f"{level} == '{x}'" for x in _ALLOWS[loosening.needs])
        rules.append(cel(f"!({loosening.cel.format(t='self')}) || {allowed}",
                         refusal_message(loosening),
                         field_path="." + loosening.field.split(".")[0]))
    return rules


def refusals(template: Any) -> list[str]:
    """The CRD's refusals again, for a PodTemplateOverride built in Python."""
    return [refusal_message(x) for x in LOOSENINGS
            if x.present(template) and template.pod_security not in _ALLOWS[x.needs]]


def loosened(template: Any) -> list[str]:
    """What a template loosens below restricted (allowed or not), one phrase each."""
    return [f"spec.template.{x.field} ({x.what})" for x in LOOSENINGS if x.present(template)]
