"""Kueue as the operator's watches keep it: the jobs' Workloads, the LocalQueues (the
namespaces with one named `default`, and which ClusterQueue each feeds), the ResourceFlavors,
the ClusterQueues, and the other Workloads that wait for quota (what a job may yield to,
policy.kueue_yield); and the few requests Kueue needs (policy.kueue says what they mean).

Kueue is read only where the apiserver serves kueue.x-k8s.io/v1beta2 (the storage version from
Kueue 0.16): probed once at startup (kueue_served). Without it a job that names a queue waits,
told why, rather than running outside the quota its platform expects it to ask for.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from elastrain_operator.k8s.cache import Key
from elastrain_operator.k8s.client import Kube, KubeError, Manifest, namespaced
from elastrain_operator.k8s.kueue_quota import pod_requests, queue_terms, waiting_of
from elastrain_operator.model.spec import API_VERSION as JOB_VERSION
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.policy.kueue import DEFAULT_QUEUE, KueueView, queue_of
from elastrain_operator.policy.kueue_slices import chain
from elastrain_operator.policy.kueue_yield import Waiting, lends
from elastrain_operator.render.workload import (
    KUEUE_API,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    RESOURCE_IN_USE,
    WORKERS,
    Priority,
    extra_workload_name,
    render_pod_sets,
)

GROUP, VERSION = KUEUE_API.split("/")


def kueue_served(kube: Kube) -> bool:
    """Whether the apiserver serves Kueue's v1beta2 Workloads (discovery)."""
    try:
        found = kube.get(f"/apis/{KUEUE_API}")
    except KubeError:
        return False
    return any(r.get("name") == "workloads" for r in (found or {}).get("resources") or [])


def _owner(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, uid) of the TrainingJob that controls a Workload, if one does."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "TrainingJob" \
                and str(ref.get("apiVersion", "")).startswith("elastrain.dev/"):
            return str(ref.get("name")), str(ref.get("uid"))
    return None


def _admitted_in(workload: Manifest | None) -> str | None:
    """The ClusterQueue that admitted a Workload, if one did."""
    admission = ((workload or {}).get("status") or {}).get("admission") or {}
    return str(admission["clusterQueue"]) if admission.get("clusterQueue") else None


def _job_key(obj: Manifest) -> Key | None:
    """(namespace, job name) of the TrainingJob that controls a Workload, if one does."""
    owner = _owner(obj)
    return None if owner is None else (str(obj["metadata"].get("namespace")), owner[0])


class KueueState:
    """Thread-safe: the watches write, reconcile rounds read."""

    def __init__(self, served: bool = True, yielding: bool = False,
                 slices: bool = False) -> None:
        self.served = served
        self.yielding = yielding  # the chart's kueue.yieldQuota (policy.kueue_yield)
        self.slices = slices  # the chart's kueue.workloadSlices (policy.kueue_slices)
        self._lock = threading.Lock()
        self._workloads: dict[Key, dict[str, Manifest]] = {}  # job key -> name -> Workload
        self._default_queues: set[str] = set()  # namespaces with a LocalQueue `default`
        self._flavors: dict[str, Manifest] = {}
        self._local_queues: dict[Key, str] = {}  # (namespace, LocalQueue) -> ClusterQueue
        self._cluster_queues: dict[str, Manifest] = {}
        # Other Workloads Kueue could not fit: (namespace, name) -> (its LocalQueue, Waiting).
        self._waiting: dict[Key, tuple[Key, Waiting]] = {}

    # ---------------------------------------------------------------------- the watch side

    def put_workload(self, obj: Manifest) -> Key | None:
        """A Workload's event; the key of the job that owns it, if a TrainingJob does."""
        key = _job_key(obj)
        if key is not None:
            with self._lock:
                self._workloads.setdefault(key, {})[str(obj["metadata"].get("name"))] = obj
        self._put_waiting(obj, deleted=False)
        return key

    def _put_waiting(self, obj: Manifest, *, deleted: bool) -> None:
        meta = obj.get("metadata") or {}
        name = (str(meta.get("namespace")), str(meta.get("name")))
        waiting = None if deleted else waiting_of(obj)
        with self._lock:
            if waiting is None:
                self._waiting.pop(name, None)
            else:
                queue = (name[0], str((obj.get("spec") or {}).get("queueName") or ""))
                self._waiting[name] = (queue, waiting)

    def jobs_waited_on(self, obj: Manifest) -> list[Key]:
        """The jobs admitted in the ClusterQueue a waiting Workload waits in: they may yield
        to it (policy.kueue_yield)."""
        meta = obj.get("metadata") or {}
        with self._lock:
            entry = self._waiting.get((str(meta.get("namespace")), str(meta.get("name"))))
            if entry is None or not self.yielding:
                return []
            cluster_queue = self._local_queues.get(entry[0])
            cohort = ((self._cluster_queues.get(cluster_queue or "") or {}).get("spec")
                      or {}).get("cohortName")
            near = {name for name, cq in self._cluster_queues.items()
                    if cohort and (cq.get("spec") or {}).get("cohortName") == cohort}
            near.add(cluster_queue or "")
            return [key for key, known in self._workloads.items()
                    if any(_admitted_in(wl) in near for wl in known.values())]

    def remove_workload(self, obj: Manifest) -> Key | None:
        key = _job_key(obj)
        self._put_waiting(obj, deleted=True)
        if key is not None:
            with self._lock:
                known = self._workloads.get(key, {})
                known.pop(str(obj["metadata"].get("name")), None)
                if not known:
                    self._workloads.pop(key, None)
        return key

    def put_local_queue(self, obj: Manifest, *, deleted: bool = False) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        with self._lock:
            if deleted:
                self._local_queues.pop(key, None)
            else:
                self._local_queues[key] = str((obj.get("spec") or {}).get("clusterQueue") or "")
        if meta.get("name") != DEFAULT_QUEUE:
            return
        with self._lock:
            if deleted:
                self._default_queues.discard(str(meta.get("namespace")))
            else:
                self._default_queues.add(str(meta.get("namespace")))

    def put_cluster_queue(self, obj: Manifest, *, deleted: bool = False) -> None:
        name = str((obj.get("metadata") or {}).get("name"))
        with self._lock:
            if deleted:
                self._cluster_queues.pop(name, None)
            else:
                self._cluster_queues[name] = obj

    def put_flavor(self, obj: Manifest, *, deleted: bool = False) -> None:
        name = str((obj.get("metadata") or {}).get("name"))
        with self._lock:
            if deleted:
                self._flavors.pop(name, None)
            else:
                self._flavors[name] = obj

    # ------------------------------------------------------------------ the reconcile side

    def workloads_of(self, job: TrainingJob) -> list[Manifest]:
        """The job's Workloads: those controlled by this very job (by uid)."""
        key = (job.metadata.namespace, job.metadata.name)
        with self._lock:
            found = list(self._workloads.get(key, {}).values())
        return [wl for wl in found if (_owner(wl) or ("", ""))[1] == job.metadata.uid]

    def orphans(self, key: Key) -> list[Manifest]:
        """Workloads of a job that is gone, still holding the finalizer we put there."""
        with self._lock:
            return [wl for wl in self._workloads.get(key, {}).values()
                    if RESOURCE_IN_USE in (wl["metadata"].get("finalizers") or [])]

    def view(self, kube: Kube | None, job: TrainingJob) -> KueueView | None:
        """What the job's round knows of Kueue; None when Kueue does not queue the job.
        `kube` None: from the watches alone, no request (reconcile.needs_round)."""
        with self._lock:
            default_queue = job.metadata.namespace in self._default_queues
        queue = queue_of(job, default_queue)
        if queue is None:
            return None
        if not self.served:
            return KueueView(queue=queue, served=False)
        mine = self.workloads_of(job)
        more = extra_workload_name(job)
        extra = next((wl for wl in mine if wl["metadata"].get("name") == more), None)
        found = chain([wl for wl in mine if wl is not extra], datetime.now(UTC))
        workload = found.main
        priority = read_priority(kube, job) if workload is None and kube is not None else None
        flavors = {**self._flavors_of(kube, workload), **self._flavors_of(kube, extra),
                   **self._flavors_of(kube, found.handover)}
        view = KueueView(queue=queue, workload=workload, extra=extra, flavors=flavors,
                         priority=priority, slices=self.slices, chain=found)
        cluster_queue = _admitted_in(workload or found.handover) if self.yielding else None
        if not cluster_queue:
            return view
        with self._lock:
            queues = dict(self._cluster_queues)
            entries = [(self._local_queues.get(queue_key), w)
                       for queue_key, w in self._waiting.values()]
        ours = queues.get(cluster_queue) or {}
        policy = (ours.get("spec") or {}).get("preemption") or {}
        terms = queue_terms(ours)
        # Those of its own ClusterQueue, and those of the cohort that it may lend to.
        waiting = tuple(w if cq == cluster_queue else dataclasses.replace(w, cohort=True)
                        for cq, w in entries
                        if cq == cluster_queue or (cq is not None and terms.cohort and lends(
                            terms, queue_terms(queues.get(cq) or {}), w)))
        if not waiting:
            return view
        workers = next(p for p in render_pod_sets(job) if p["name"] == WORKERS)
        return dataclasses.replace(
            view, yielding=True, waiting=waiting,
            within_cluster_queue=policy.get("withinClusterQueue"),
            per_worker=pod_requests(workers["template"]))

    def _flavors_of(self, kube: Kube | None,
                    workload: Manifest | None) -> dict[str, Manifest]:
        """The ResourceFlavors an admission names, from the watch; one the watch has not
        delivered yet is read (and kept)."""
        admission = ((workload or {}).get("status") or {}).get("admission") or {}
        names = {str(f) for a in admission.get("podSetAssignments") or []
                 for f in (a.get("flavors") or {}).values()}
        found: dict[str, Manifest] = {}
        for name in sorted(names):
            with self._lock:
                flavor = self._flavors.get(name)
            if flavor is None and kube is not None:
                flavor = kube.get(f"/apis/{KUEUE_API}/resourceflavors/{name}")
                if flavor is not None:
                    self.put_flavor(flavor)
            if flavor is not None:
                found[name] = flavor
        return found


def read_priority(kube: Kube, job: TrainingJob) -> Priority | None:
    """The class the Workload is ordered by: a WorkloadPriorityClass named by the job's
    kueue.x-k8s.io/priority-class label, else the workers' PriorityClass; a class that does not
    exist gives none (Kueue's default priority, 0)."""
    if name := job.metadata.labels.get(PRIORITY_LABEL):
        kind, path = "WorkloadPriorityClass", f"/apis/{KUEUE_API}/workloadpriorityclasses/{name}"
    elif name := job.spec.template.priority_class_name or "":
        kind, path = "PriorityClass", f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}"
    else:
        return None
    found = kube.get(path)
    if found is None:
        return None
    return Priority(kind=kind, name=name, value=int(found.get("value") or 0))


def workload_path(namespace: str, name: str = "") -> str:
    return namespaced(KUEUE_API, namespace, "workloads", name)


def create_workload(kube: Kube, manifest: Manifest) -> bool:
    """True when created, False when it already existed."""
    return kube.create(workload_path(manifest["metadata"]["namespace"]), manifest) is not None


def patch_workload_status(kube: Kube, workload: Manifest, patch: Manifest) -> bool:
    """Merge-patch the status with the resourceVersion read in the patch: False when the
    Workload changed since (Kueue wrote it: the next round decides again) or is gone."""
    return _patch(kube, workload, patch, "/status")


def patch_workload(kube: Kube, workload: Manifest, patch: Manifest) -> bool:
    """patch_workload_status's for the Workload itself (its spec and metadata)."""
    return _patch(kube, workload, patch, "")


def _patch(kube: Kube, workload: Manifest, patch: Manifest, sub: str) -> bool:
    meta = workload["metadata"]
    try:
        kube.patch(workload_path(meta["namespace"], meta["name"]) + sub, patch)
    except KubeError as err:
        if err.conflict or err.not_found:
            return False
        raise
    return True


def delete_workload(kube: Kube, workload: Manifest) -> None:
    """Delete it if it is still the one read (a precondition on its uid and version)."""
    meta = workload["metadata"]
    body = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {
        "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}}
    try:
        kube.delete(workload_path(meta["namespace"], meta["name"]), body=body)
    except KubeError as err:
        if not err.conflict:  # changed since: the next round decides again
            raise


def release_workload(kube: Kube, workload: Manifest) -> None:
    """Remove our finalizer (guarded by the resourceVersion read)."""
    meta = workload["metadata"]
    finalizers = list(meta.get("finalizers") or [])
    if RESOURCE_IN_USE not in finalizers:
        return
    patch = [{"op": "test", "path": "/metadata/resourceVersion",
              "value": meta["resourceVersion"]},
             {"op": "replace", "path": "/metadata/finalizers",
              "value": [f for f in finalizers if f != RESOURCE_IN_USE]}]
    try:
        kube.patch(workload_path(meta["namespace"], meta["name"]), patch, kind="json")
    except KubeError as err:
        if err.status not in (404, 409, 422):  # gone, or changed: its next event retries
            raise


def label_queue(kube: Kube, namespace: str, name: str, queue: str) -> None:
    """Give the job the queue label it is queued under (policy.kueue.WorkloadWrite)."""
    kube.patch(namespaced(f"elastrain.dev/{JOB_VERSION}", namespace, "trainingjobs", name),
               {"metadata": {"labels": {QUEUE_LABEL: queue}}})
