"""Observe a TrainingJob's children: the `observe` step of a reconcile.

Only objects whose controller owner reference is this very job (by uid) are the job's; pods
that carry the job's name but another uid belong to a deleted job of the same name and are only
released (their finalizer removed) so the garbage collector can finish them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastrain_operator.k8s.client import Kube, Manifest, namespaced
from elastrain_operator.model.names import (
    LABEL_JOB,
    LABEL_ROLE,
    ROLE_STORE,
    ROLE_WORKER,
    WORKER_FINALIZER,
    store_name,
    worker_service_name,
)
from elastrain_operator.model.spec import API_GROUP, API_VERSION, PLURAL, TrainingJob
from elastrain_operator.policy.failures import WorkerPod, read_worker_pod
from elastrain_operator.policy.planning import Observed, StorePod

GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"


@dataclass(frozen=True)
class Children:
    """What observe() found: the planner's view plus the raw objects the shell needs."""

    observed: Observed
    pods: dict[str, Manifest] = field(default_factory=dict)
    orphans: tuple[str, ...] = ()  # same job name, another (deleted) job's uid, finalizer set


def job_path(namespace: str, name: str = "") -> str:
    return namespaced(GROUP_VERSION, namespace, PLURAL, name)


def read_job(kube: Kube, namespace: str, name: str) -> Manifest | None:
    return kube.get(job_path(namespace, name))


def controller_uid(obj: Manifest) -> str:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid", ""))
    return ""


def _services(kube: Kube, job: TrainingJob) -> tuple[frozenset[str], frozenset[str]]:
    ours: set[str] = set()
    foreign: set[str] = set()
    for name in (worker_service_name(job.metadata.name), store_name(job.metadata.name)):
        svc = kube.get(namespaced("v1", job.metadata.namespace, "services", name))
        if svc is None:
            continue
        (ours if controller_uid(svc) == job.metadata.uid else foreign).add(name)
    return frozenset(ours), frozenset(foreign)


def observe(kube: Kube, job: TrainingJob) -> Children:
    ns, uid = job.metadata.namespace, job.metadata.uid
    pods = kube.list(namespaced("v1", ns, "pods"), labels=f"{LABEL_JOB}={job.metadata.name}")
    workers: list[WorkerPod] = []
    raw: dict[str, Manifest] = {}
    orphans: list[str] = []
    store: StorePod | None = None
    for pod in pods:
        meta = pod.get("metadata") or {}
        name, role = str(meta.get("name")), (meta.get("labels") or {}).get(LABEL_ROLE)
        if controller_uid(pod) != uid:
            if WORKER_FINALIZER in (meta.get("finalizers") or []):
                orphans.append(name)
                raw[name] = pod
            continue
        raw[name] = pod
        if role == ROLE_WORKER and (worker := read_worker_pod(pod, WORKER_FINALIZER)):
            workers.append(worker)
        elif role == ROLE_STORE and name == store_name(job.metadata.name):
            store = StorePod(phase=str((pod.get("status") or {}).get("phase") or "Pending"),
                             deleting=bool(meta.get("deletionTimestamp")))
    services, foreign = _services(kube, job)
    return Children(
        observed=Observed(workers=tuple(workers), store=store, services=services,
                          foreign_services=foreign),
        pods=raw, orphans=tuple(orphans))


def orphaned_pods(kube: Kube, namespace: str, job_name: str) -> list[str]:
    """Pods of a job that no longer exists that still hold the accounting finalizer."""
    pods = kube.list(namespaced("v1", namespace, "pods"), labels=f"{LABEL_JOB}={job_name}")
    return [str(p["metadata"]["name"]) for p in pods
            if WORKER_FINALIZER in (p["metadata"].get("finalizers") or [])]
