"""Names, labels and the finalizer of the objects a TrainingJob owns.

One place decides every child's name, so the renderers, the planner and the cluster adapter
cannot disagree about what "the store pod of job X" is called.
"""

from __future__ import annotations

from typing import Final

LABEL_PREFIX: Final = "elastrain.dev"
LABEL_JOB: Final = f"{LABEL_PREFIX}/job-name"        # every child of a job
LABEL_ROLE: Final = f"{LABEL_PREFIX}/role"           # "worker" or "rdzv-store"
LABEL_INDEX: Final = f"{LABEL_PREFIX}/worker-index"  # stable worker slot, 0..replicas-1
LABEL_ATTEMPT: Final = f"{LABEL_PREFIX}/attempt"     # the slot's attempt the pod belongs to
ROLE_WORKER: Final = "worker"
ROLE_STORE: Final = "rdzv-store"
ROLE_NETWORK: Final = "network-policy"  # the job's NetworkPolicy (no pods carry it)
ROLE_CONTROL: Final = "control"  # the Secret holding the job's control token (control.py)

# Kubernetes' own Job controller keeps pods with a finalizer until it has counted them
# (batch.kubernetes.io/job-tracking); ours does the same for worker pods, see WorkerSlot.
WORKER_FINALIZER: Final = f"{LABEL_PREFIX}/worker-accounting"

TRAINER_CONTAINER: Final = "trainer"
STORE_CONTAINER: Final = "rdzv-store"
METRICS_PORT_NAME: Final = "metrics"
RDZV_PORT_NAME: Final = "rdzv"

# A hostname is a DNS label (63 characters) and must fit "<job>-worker-<index>".
MAX_JOB_NAME_LENGTH: Final = 63 - len("-worker-1023")

MANAGED_BY: Final = {"app.kubernetes.io/name": "elastrain",
                     "app.kubernetes.io/managed-by": "elastrain-operator"}


def worker_hostname(job: str, index: int) -> str:
    """Stable DNS name of a worker slot: survives replacements of its pod."""
    return f"{job}-worker-{index}"


def worker_pod_name(job: str, index: int, attempt: int) -> str:
    """Each attempt gets its own pod name, so a replacement never waits for the old pod to go."""
    return f"{job}-worker-{index}-{attempt}"


def worker_service_name(job: str) -> str:
    """The headless Service giving workers DNS names (their pods' subdomain)."""
    return f"{job}-workers"


def store_name(job: str) -> str:
    """The rendezvous store's pod and Service share this name."""
    return f"{job}-rdzv"


def network_policy_name(job: str) -> str:
    """The job's NetworkPolicy (render.network)."""
    return f"{job}-network"


def control_secret_name(job: str) -> str:
    """The Secret with the job's control token, which its in-process workers mount."""
    return f"{job}-control"


def store_host(job: str, namespace: str) -> str:
    return f"{store_name(job)}.{namespace}.svc"


def job_labels(job: str) -> dict[str, str]:
    return {**MANAGED_BY, LABEL_JOB: job}


def worker_selector(job: str) -> str:
    """The serialized selector of a job's workers (status.selector, for the scale subresource)."""
    return f"{LABEL_JOB}={job},{LABEL_ROLE}={ROLE_WORKER}"
