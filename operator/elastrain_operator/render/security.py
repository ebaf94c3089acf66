"""The security contexts and scratch volumes of every pod the operator creates.

Rendered with no input, a worker or store pod passes Pod Security `restricted`: a non-root
numeric user (65532, the images' user, set explicitly so an image whose USER is root or a name
still starts under runAsNonRoot), no privilege escalation, every capability dropped, seccomp
RuntimeDefault, and a read-only root filesystem. What the trainer and torchrun write goes to
emptyDirs: /tmp (torchrun's log directories, tempfile) and, on workers, a memory-backed /dev/shm
(the container runtime's default is 64 MiB: DataLoader workers and NCCL die of SIGBUS in it).
The job's own settings (spec.template.podSecurityContext/securityContext, checked against
`restricted` at admission) are laid over these defaults field by field.
"""

from __future__ import annotations

import re
from typing import Any

from elastrain_operator.model.pod import PodTemplateOverride
from elastrain_operator.model.pod_security import DEFAULT_USER
from elastrain_operator.model.spec import TrainingJobSpec
from elastrain_operator.render.meta import Manifest

TMP_VOLUME = "elastrain-tmp"
SHM_VOLUME = "elastrain-shm"
# Per local process: NCCL's shared-memory transport and a few DataLoader workers' batches fit.
SHM_PER_PROCESS_GI = 1
_ZERO = re.compile(r"^\+?0*(\.0*)?([eE][-+]?\d+|[mkKMGTPE]i?)?$")


def _set(fields: dict[str, Any]) -> Manifest:
    return {k: v for k, v in fields.items() if v is not None}


def pod_security_context(template: PodTemplateOverride) -> Manifest:
    own = template.pod_security_context
    ctx: Manifest = {
        "runAsNonRoot": True,
        "runAsUser": DEFAULT_USER,
        "runAsGroup": DEFAULT_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if own is not None:
        ctx.update(own.to_api())
        if own.run_as_user == 0 and own.run_as_non_root is None:
            ctx["runAsNonRoot"] = False  # the user asked for root (podSecurity allows it)
        if not own.supplemental_groups:
            ctx.pop("supplementalGroups", None)
    return ctx


def container_security_context(template: PodTemplateOverride) -> Manifest:
    own = template.security_context
    ctx: Manifest = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    if own is not None:
        ctx.update(_set({
            "allowPrivilegeEscalation": own.allow_privilege_escalation,
            "readOnlyRootFilesystem": own.read_only_root_filesystem,
            "privileged": own.privileged,
        }))
        if own.capabilities and own.capabilities.add:
            ctx["capabilities"] = {"drop": ["ALL"], "add": list(own.capabilities.add)}
        if own.privileged:
            ctx["allowPrivilegeEscalation"] = True  # the apiserver refuses privileged without it
    return ctx


def store_container_security_context() -> Manifest:
    """The store runs the operator's program, not the user's: restricted, whatever the job
    loosened for its trainer (the pod-level user and fsGroup still apply)."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def local_processes(spec: TrainingJobSpec) -> int:
    """Processes per worker pod ("auto" starts one per GPU)."""
    nproc = spec.effective_nproc_per_node
    return nproc if isinstance(nproc, int) else max(spec.gpu_count, 1)


def shm_size(spec: TrainingJobSpec) -> str | None:
    """The /dev/shm emptyDir's sizeLimit; None when the job turned it off with 0."""
    size = spec.template.shm_size
    if size is None:
        return f"{SHM_PER_PROCESS_GI * local_processes(spec)}Gi"
    if _ZERO.match(str(size)):
        return None
    return str(size)


def scratch_volumes(spec: TrainingJobSpec, *, shm: bool) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, volumeMounts) of the writable scratch a read-only root filesystem needs."""
    volumes: list[Manifest] = [{"name": TMP_VOLUME, "emptyDir": {}}]
    mounts: list[Manifest] = [{"name": TMP_VOLUME, "mountPath": "/tmp"}]
    if shm and (size := shm_size(spec)) is not None:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": size}})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    return volumes, mounts
