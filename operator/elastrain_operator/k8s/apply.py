"""Apply a plan: write the status (with an optimistic lock), then create and delete children.

The status goes first because it records the counting (slot attempts) that makes every later
step safe to repeat; if the write loses a race (409) nothing else is done this round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from elastrain_operator.k8s.client import Kube, KubeError, Manifest, namespaced
from elastrain_operator.k8s.observe import job_path
from elastrain_operator.model.names import WORKER_FINALIZER
from elastrain_operator.model.status import TrainingJobStatus

log = logging.getLogger(__name__)
RELEASE_ATTEMPTS = 5


class StatusConflict(Exception):
    """Someone changed the job since we read it; reconcile again from a fresh read."""


@dataclass(frozen=True)
class Applied:
    workers_created: int = 0
    create_errors: tuple[str, ...] = ()
    present: tuple[str, ...] = ()  # children created now or found existing


def write_status(kube: Kube, raw_job: Manifest, status: TrainingJobStatus) -> Manifest:
    """PUT the whole status with the resourceVersion we read: a lost race raises, as does a
    job deleted since (our copy may be the watch's). Returns the job as written."""
    meta = raw_job["metadata"]
    body = {**raw_job, "status": status.to_api()}
    try:
        return kube.request("PUT", job_path(meta["namespace"], meta["name"]) + "/status",
                            body=body)
    except KubeError as err:
        if err.conflict or err.not_found:
            raise StatusConflict(str(err)) from err
        raise


def delete_pod(kube: Kube, namespace: str, name: str, *, force: bool = False) -> None:
    """`force`: grace period 0, so the object goes without waiting for its kubelet (a pod on
    a node that stopped answering would stay Terminating until the node does)."""
    body: Manifest = {"propagationPolicy": "Background"}
    if force:
        body["gracePeriodSeconds"] = 0
    kube.delete(namespaced("v1", namespace, "pods", name), body=body)


def release_pod(kube: Kube, namespace: str, name: str) -> None:
    """Remove the accounting finalizer, guarded by the pod's resourceVersion."""
    path = namespaced("v1", namespace, "pods", name)
    for _ in range(RELEASE_ATTEMPTS):
        pod = kube.get(path)
        if pod is None:
            return
        finalizers = list(pod["metadata"].get("finalizers") or [])
        if WORKER_FINALIZER not in finalizers:
            return
        patch = [{"op": "test", "path": "/metadata/resourceVersion",
                  "value": pod["metadata"]["resourceVersion"]},
                 {"op": "replace", "path": "/metadata/finalizers",
                  "value": [f for f in finalizers if f != WORKER_FINALIZER]}]
        try:
            kube.patch(path, patch, kind="json")
            return
        except KubeError as err:
            if err.status not in (409, 422):  # a failed "test" op is 422: retry on a fresh read
                raise
    raise RuntimeError(f"could not release pod {namespace}/{name}: it keeps changing")


def create_child(kube: Kube, manifest: Manifest) -> bool:
    """True when created, False when it already existed."""
    meta = manifest["metadata"]
    plural = {"Pod": "pods", "Service": "services", "NetworkPolicy": "networkpolicies",
              "Secret": "secrets"}[manifest["kind"]]
    return kube.create(namespaced(manifest["apiVersion"], meta["namespace"], plural),
                       manifest) is not None


def apply_children(kube: Kube, namespace: str, *, delete: tuple[str, ...],
                   release: tuple[str, ...], create: tuple[Manifest, ...],
                   force_delete: tuple[str, ...] = ()) -> Applied:
    for name in delete:
        delete_pod(kube, namespace, name)
    for name in force_delete:
        delete_pod(kube, namespace, name, force=True)
    for name in release:
        release_pod(kube, namespace, name)
    created, errors, present = 0, [], []
    for manifest in create:
        try:
            new = create_child(kube, manifest)
            present.append(manifest["metadata"]["name"])
            if new and manifest["kind"] == "Pod" and \
                    manifest["metadata"]["labels"].get("elastrain.dev/role") == "worker":
                created += 1
        except KubeError as err:
            # Quota, admission webhooks, a bad template: report and go on with the others.
            errors.append(f"{manifest['kind']} {manifest['metadata']['name']}: {err}")
            log.warning("creating %s failed: %s", manifest["metadata"]["name"], err)
    return Applied(workers_created=created, create_errors=tuple(errors), present=tuple(present))


def delete_job(kube: Kube, namespace: str, name: str) -> None:
    kube.delete(job_path(namespace, name), body={"propagationPolicy": "Background"})
