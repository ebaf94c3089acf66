"""The spec checks the operator makes at reconcile time; the CRD refuses the rest at admission.

Every rule the apiserver can check on the TrainingJob alone is a CEL rule or schema bound in the
CRD (model/spec.py), so `kubectl apply` refuses it with a message naming the field, e.g. a
metadata.name too long for `<name>-worker-<index>` hostnames. What is left here, and why it stays:

- `validate`: the CRD's rules that would otherwise break the job's children (metadata.name's
  length and DNS-1035 shape, nprocPerNode "auto" without a GPU), checked again with the CRD's
  own messages. A CRD update does not re-validate stored objects (and Helm never upgrades
  `crds/`), so a job admitted by an older CRD still gets InvalidSpec instead of children the
  apiserver refuses one by one. (Every other CEL rule is mirrored by the pydantic model, whose
  refusal reconcile reports as InvalidSpec too.)
- Services with a child's name not owned by the job (`plan`, "exists and is not owned by this
  TrainingJob"): they are other objects, which CEL cannot read, and can appear after admission.
- `pod_config_problems`: what only the kubelet can see (a missing credentials or image pull
  Secret, an image that cannot be pulled). A Secret may be created after the job, and the
  operator has no access to Secrets, so these are read from the worker pods' waiting reasons;
  once the Secret appears the kubelet proceeds and the condition clears.

A problem here is reported as Valid=False/InvalidSpec, never raised, so it cannot put the
operator in a crash loop. Problems of the spec alone block new pods.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from elastrain_operator.model.names import MAX_JOB_NAME_LENGTH
from elastrain_operator.model.spec import (
    NAME_DNS_LABEL_MESSAGE,
    NAME_LENGTH_MESSAGE,
    NPROC_AUTO_MESSAGE,
    TrainingJob,
)
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
    """The CRD's child-breaking rules again, for jobs an older CRD admitted; see above."""
    problems: list[str] = []
    name = job.metadata.name
    if len(name) > MAX_JOB_NAME_LENGTH:
        problems.append(NAME_LENGTH_MESSAGE)
    if not _DNS_1035.match(name):
        problems.append(NAME_DNS_LABEL_MESSAGE)
    if job.spec.nproc_per_node == "auto" and not _has_accelerator(job):
        problems.append(NPROC_AUTO_MESSAGE)
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
