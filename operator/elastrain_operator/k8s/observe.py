"""Observe a TrainingJob's children: the `observe` step of a reconcile.

From the operator's watch-fed view (k8s.cache) when it can be trusted, else live (a LIST of the
job's pods, a GET of its two Services and, when the operator renders them, of its NetworkPolicy)
and the view is refreshed from what was read.

Only objects whose controller owner reference is this very job (by uid) are the job's; pods
that carry the job's name but another uid belong to a deleted job of the same name and are only
released (their finalizer removed) so the garbage collector can finish them.
"""

from __future__ import annotations

from elastrain_operator.k8s.cache import (
    Cache,
    Children,
    build_children,
    controller_uid,
    read_pod_record,
)
from elastrain_operator.k8s.client import Kube, Manifest, namespaced
from elastrain_operator.model.names import (
    LABEL_JOB,
    WORKER_FINALIZER,
    network_policy_name,
    store_name,
    worker_service_name,
)
from elastrain_operator.model.spec import API_GROUP, API_VERSION, PLURAL, TrainingJob

GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"
NETWORKING = "networking.k8s.io/v1"
__all__ = ["Children", "controller_uid", "job_path", "observe", "orphaned_pods", "read_job"]


def job_path(namespace: str, name: str = "") -> str:
    return namespaced(GROUP_VERSION, namespace, PLURAL, name)


def read_job(kube: Kube, namespace: str, name: str) -> Manifest | None:
    return kube.get(job_path(namespace, name))


def read_children(kube: Kube, namespace: str, job_name: str, *,
                  network_policy: bool = False) -> tuple[list[Manifest], list[Manifest]]:
    """Live: the pods labelled with the job's name, its two Services and its NetworkPolicy
    (those that exist; the policy only when asked for), the latter kept with the Services."""
    pods = kube.list(namespaced("v1", namespace, "pods"), labels=f"{LABEL_JOB}={job_name}")
    paths = [namespaced("v1", namespace, "services", name)
             for name in (worker_service_name(job_name), store_name(job_name))]
    if network_policy:
        paths.append(namespaced(NETWORKING, namespace, "networkpolicies",
                                network_policy_name(job_name)))
    services = [obj for path in paths if (obj := kube.get(path)) is not None]
    return pods, services


def observe(kube: Kube, job: TrainingJob, cache: Cache | None = None, *,
            network_policy: bool = False) -> Children:
    ns, name, uid = job.metadata.namespace, job.metadata.name, job.metadata.uid
    if cache is not None and (seen := cache.children((ns, name), uid)) is not None:
        return seen
    token = cache.begin() if cache is not None else None
    pods, services = read_children(kube, ns, name, network_policy=network_policy)
    if cache is not None and token is not None:
        cache.refresh((ns, name), pods, services, token)
    return build_children({str(p["metadata"]["name"]): read_pod_record(p, name) for p in pods},
                          {str(s["metadata"]["name"]): controller_uid(s) for s in services},
                          job_name=name, uid=uid)


def orphaned_pods(kube: Kube, namespace: str, job_name: str,
                  cache: Cache | None = None) -> list[str]:
    """Pods of a job that no longer exists that still hold the accounting finalizer."""
    if cache is not None and (known := cache.orphans((namespace, job_name))) is not None:
        return known
    pods = kube.list(namespaced("v1", namespace, "pods"), labels=f"{LABEL_JOB}={job_name}")
    return [str(p["metadata"]["name"]) for p in pods
            if WORKER_FINALIZER in (p["metadata"].get("finalizers") or [])]
