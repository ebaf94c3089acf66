"""Checks CEL cannot express: they need other objects or names the CRD cannot see.

A problem here is reported as Valid=False/InvalidSpec, never raised, so it cannot put the
operator in a crash loop. Problems of the spec alone block new pods. Problems only the kubelet
can see (a missing credentials or image pull Secret, an image that cannot be pulled) are read
from the worker pods' waiting reasons instead of reading Secrets: the operator needs no access to
Secrets, and once the Secret appears the kubelet proceeds and the condition clears.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from elastrain_operator.model.names import MAX_JOB_NAME_LENGTH
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.policy.failures import WorkerPod

# Container waiting reasons that mean the spec, not the platform, is wrong.
CONFIG_ERRORS = frozenset({"CreateContainerConfigError", "ErrImagePull", "ImagePullBackOff",
                           "InvalidImageName", "CreateContainerError"})

# Services are DNS-1035 labels: they must start with a letter.
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _has_accelerator(job: TrainingJob) -> bool:
    res = job.spec.resources
    return any(key.endswith("/gpu") for key in [*res.limits, *res.requests])


def validate(job: TrainingJob) -> list[str]:
    """Every problem of the spec, each message naming the field it is about."""
    problems: list[str] = []
    name = job.metadata.name
    if len(name) > MAX_JOB_NAME_LENGTH:
        problems.append(f"metadata.name must be at most {MAX_JOB_NAME_LENGTH} characters: "
                        "worker hostnames are <name>-worker-<index>")
    if not _DNS_1035.match(name):
        problems.append("metadata.name must start with a letter: it names the job's Services")
    if job.spec.nproc_per_node == "auto" and not _has_accelerator(job):
        problems.append("spec.nprocPerNode \"auto\" needs a GPU in spec.resources "
                        "(e.g. limits nvidia.com/gpu); set an integer for CPU workers")
    return problems


def pod_config_problems(workers: Iterable[WorkerPod]) -> list[str]:
    """What the kubelet refuses to start, once per distinct message (e.g. Secret not found)."""
    seen: dict[str, None] = {}
    for pod in workers:
        if pod.waiting_reason in CONFIG_ERRORS and not pod.deleting:
            hint = " (check spec.checkpoint.credentialsSecret, spec.image, " \
                   "spec.template.imagePullSecrets)"
            seen[f"worker pod {pod.name}: {pod.waiting_reason}: {pod.waiting_message}{hint}"] = None
    return list(seen)[:3]
