"""The operator's in-memory view of TrainingJobs and of the pods, Services and NetworkPolicies
named after them (a NetworkPolicy is kept like a Service: its name and controller owner).

The watch streams (kopf event handlers) feed it, so a reconcile reads a job's children from
here instead of listing them: the cost of a job follows changes to it, not the number of jobs.
Each pod is kept as the few fields the planner reads (policy.failures.WorkerPod / StorePod), so
an event that changes nothing the planner reads (a scheduler retry on an unschedulable pod)
is recognised as such and wakes nobody.

The view of one job's children is trusted only when
1. a live observation of that job has been made since the watch streams last (re)listed: a
   re-list (after a peering pause or an expired watch) reports what exists, never what vanished
   meanwhile, so every job is re-read live once after it;
2. every child this process created for the job has since been seen on the watch ("expectations",
   as in Kubernetes' ReplicaSet controller): a round never plans from a view that lags its own
   last creations, so a slot is never counted lost because its new pod was not seen yet.
Otherwise children() answers None and the caller observes the cluster live, then refresh()es.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from pydantic import ValidationError

from elastrain_operator.k8s.client import Manifest
from elastrain_operator.model.names import (
    LABEL_JOB,
    LABEL_ROLE,
    ROLE_STORE,
    ROLE_WORKER,
    WORKER_FINALIZER,
    network_policy_name,
    store_name,
    worker_service_name,
)
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.policy.failures import WorkerPod, answers_progress, read_worker_pod
from elastrain_operator.policy.planning import Observed
from elastrain_operator.policy.store import StorePod, read_store_pod

Key = tuple[str, str]  # (namespace, job name)
EXPECTATION_SECONDS = 30.0  # a created child not seen by then: stop waiting, observe live


def controller_uid(obj: Manifest) -> str:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid", ""))
    return ""


@dataclass(frozen=True)
class PodRecord:
    """What a reconcile needs of one pod labelled with a job's name."""

    owner: str  # the controller owner's uid
    finalizer: bool  # holds the accounting finalizer
    worker: WorkerPod | None = None
    store: StorePod | None = None


def read_pod_record(pod: Manifest, job_name: str) -> PodRecord:
    meta = pod.get("metadata") or {}
    role, name = (meta.get("labels") or {}).get(LABEL_ROLE), str(meta.get("name"))
    worker = read_worker_pod(pod, WORKER_FINALIZER) if role == ROLE_WORKER else None
    store = None
    if role == ROLE_STORE and name == store_name(job_name):
        store = read_store_pod(pod)
    return PodRecord(owner=controller_uid(pod),
                     finalizer=WORKER_FINALIZER in (meta.get("finalizers") or []),
                     worker=worker, store=store)


@dataclass(frozen=True)
class Children:
    """A job's children as the planner sees them, plus orphans to release."""

    observed: Observed
    orphans: tuple[str, ...] = ()  # same job name, another (deleted) job's uid, finalizer set


def build_children(pods: dict[str, PodRecord], services: dict[str, str], *, job_name: str,
                   uid: str) -> Children:
    """Pure: split by controller uid, as observe() always did."""
    workers: list[WorkerPod] = []
    orphans: list[str] = []
    store: StorePod | None = None
    for name, rec in sorted(pods.items()):
        if rec.owner != uid:
            if rec.finalizer:
                orphans.append(name)
            continue
        if rec.worker is not None:
            workers.append(rec.worker)
        elif rec.store is not None:
            store = rec.store
    ours = {n for n, owner in services.items() if owner == uid}
    wanted = {worker_service_name(job_name), store_name(job_name)}
    return Children(
        observed=Observed(workers=tuple(workers), store=store,
                          services=frozenset(ours & wanted),
                          foreign_services=frozenset((set(services) - ours) & wanted),
                          network_policy=network_policy_name(job_name) in services),
        orphans=tuple(orphans))


@dataclass(frozen=True)
class CachedJob:
    raw: Manifest
    job: TrainingJob | None  # None: our model refuses what the apiserver accepted


@dataclass
class _View:
    pods: dict[str, PodRecord] = field(default_factory=dict)
    services: dict[str, str] = field(default_factory=dict)  # name -> controller uid
    expected: dict[str, float] = field(default_factory=dict)  # child name -> give-up time
    touched: dict[str, int] = field(default_factory=dict)  # child name -> seq of its last event
    verified_epoch: int = -1


@dataclass(frozen=True)
class Token:
    """When a live observation began: a re-list or a newer event since then wins over it."""

    epoch: int
    seq: int


class Cache:
    """Thread-safe: the event loop writes, reconcile threads read."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[Key, CachedJob] = {}
        self._views: dict[Key, _View] = {}
        self._epoch = 0
        self._seq = 0  # counts watch events: orders them against live observations
        self._versions: dict[Key, int] = {}  # bumped by every change of a job or its view
        self._quiet: dict[Key, tuple[tuple[int, int], datetime]] = {}
        self._clock = clock

    # -------------------------------------------------------------------- the watch side

    def put_job(self, raw: Manifest, *, written_over: str | None = None) -> bool:
        """A TrainingJob as the watch saw it; False when we already had this version.
        written_over: `raw` is what our own status write returned, and this the resourceVersion
        that write was guarded by. It replaces only that version: the watch may since have seen
        the job deleted (or re-created under its name: a dead job put back would be planned
        for in its successor's place), or changed again after our write (a spec patched the
        moment our status showed: its event may come in before this thread gets here, and the
        older job put back over it would never be planned from again)."""
        meta = raw.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        with self._lock:
            known = self._jobs.get(key)
            if written_over is not None and (
                    known is None or known.raw["metadata"].get("uid") != meta.get("uid")
                    or known.raw["metadata"].get("resourceVersion") != written_over):
                return False
            if known is not None and known.raw["metadata"].get("resourceVersion") == \
                    meta.get("resourceVersion"):
                return False
        try:
            job: TrainingJob | None = TrainingJob.model_validate(raw)
        except ValidationError:
            job = None
        with self._lock:
            self._jobs[key] = CachedJob(raw=raw, job=job)
            self._bump(key)
        return True

    def drop_job(self, key: Key, uid: str | None = None) -> None:
        """The job `uid` (None: any) was deleted. kopf handles each uid's events in order but
        different uids' concurrently: a job re-created under the same name may be here already,
        and stays."""
        with self._lock:
            known = self._jobs.get(key)
            if known is not None and uid is not None \
                    and known.raw["metadata"].get("uid") != uid:
                return
            self._jobs.pop(key, None)
            view = self._views.get(key)
            if view is not None:
                # Its children's creations, still unseen, will never come (or come as a dead
                # job's, whose events say so): a job re-created under this name must not wait.
                view.expected.clear()
            # Bumped, not forgotten: a check still in flight for the deleted job must not
            # match a job re-created under the same name.
            self._bump(key)

    def job(self, key: Key) -> CachedJob | None:
        with self._lock:
            return self._jobs.get(key)

    def jobs(self) -> list[Key]:
        with self._lock:
            return list(self._jobs)

    def relisted(self) -> None:
        """A watch stream (re)listed: what vanished meanwhile is unknown, so trust no view."""
        with self._lock:
            self._epoch += 1

    def put_pod(self, pod: Manifest) -> Key | None:
        """Returns the job's key when the planner's view of that job changed."""
        meta = pod.get("metadata") or {}
        job_name = (meta.get("labels") or {}).get(LABEL_JOB)
        if not job_name:
            return None
        key, name = (str(meta.get("namespace")), str(job_name)), str(meta.get("name"))
        record = read_pod_record(pod, job_name)
        with self._lock:
            view = self._touch(key, name)
            if view.pods.get(name) == record:
                return None
            view.pods[name] = record
            self._bump(key)
        return key

    def put_service(self, svc: Manifest) -> Key | None:
        meta = svc.get("metadata") or {}
        job_name = (meta.get("labels") or {}).get(LABEL_JOB)
        if not job_name:
            return None
        key, name = (str(meta.get("namespace")), str(job_name)), str(meta.get("name"))
        owner = controller_uid(svc)
        with self._lock:
            view = self._touch(key, name)
            if view.services.get(name) == owner:
                return None
            view.services[name] = owner
            self._bump(key)
        return key

    def remove(self, kind: str, obj: Manifest) -> Key | None:
        """A pod, Service or NetworkPolicy is gone (kind: "pods", or any other plural)."""
        meta = obj.get("metadata") or {}
        job_name = (meta.get("labels") or {}).get(LABEL_JOB)
        if not job_name:
            return None
        key, name = (str(meta.get("namespace")), str(job_name)), str(meta.get("name"))
        with self._lock:
            view = self._touch(key, name)
            found = (view.pods if kind == "pods" else view.services).pop(name, None)
            self._bump(key)
            if not view.pods and not view.services and key not in self._jobs:
                del self._views[key]  # a deleted job's last child: keep no trace
        return key if found is not None else None

    def _touch(self, key: Key, name: str) -> _View:
        """Under the lock: the bookkeeping of every watch event about one child."""
        self._seq += 1
        view = self._views.setdefault(key, _View())
        if view.expected.pop(name, None) is not None:
            self._bump(key)
        view.touched[name] = self._seq
        return view

    def _bump(self, key: Key) -> None:
        """Under the lock: what a check of this job found no longer holds."""
        self._versions[key] = self._versions.get(key, 0) + 1
        self._quiet.pop(key, None)

    def stale(self, key: Key) -> None:
        """Something a check of this job reads outside this view changed (its Kueue
        Workload, k8s.kueue): the next check plans again."""
        with self._lock:
            self._bump(key)

    def jobs_on(self, node: str) -> list[Key]:
        """The jobs with a worker pod on `node`, their checks made stale: what the node says
        changed (k8s.nodes), and their plans read it."""
        with self._lock:
            keys = [k for k, v in self._views.items()
                    if any(r.worker is not None and r.worker.node == node
                           for r in v.pods.values())]
            for key in keys:
                self._bump(key)
        return keys

    # ------------------------------------------------------------- checks that found nothing

    def signature(self, key: Key) -> tuple[int, int]:
        """Changes whenever anything a check of this job reads changes."""
        with self._lock:
            return self._epoch, self._versions.get(key, 0)

    def set_quiet(self, key: Key, signature: tuple[int, int], until: datetime) -> None:
        """A check with these inputs found nothing to do, now and at `until`."""
        with self._lock:
            if self.signature_locked(key) == signature:
                self._quiet[key] = (signature, until)

    def is_quiet(self, key: Key, now: datetime) -> bool:
        """Nothing changed since a check found nothing to do up to a time still ahead."""
        with self._lock:
            quiet = self._quiet.get(key)
            return quiet is not None and quiet[0] == self.signature_locked(key) \
                and now < quiet[1]

    def signature_locked(self, key: Key) -> tuple[int, int]:
        return self._epoch, self._versions.get(key, 0)

    # ------------------------------------------------------------------ the reconcile side

    def children(self, key: Key, uid: str) -> Children | None:
        """The trusted view of a job's children, or None: observe live, then refresh()."""
        with self._lock:
            view = self._views.get(key)
            if view is None or view.verified_epoch != self._epoch or view.expected:
                return None
            return build_children(view.pods, view.services, job_name=key[1], uid=uid)

    def waiting(self, key: Key) -> bool:
        """True while children this process created are still unseen (not yet timed out)."""
        now = self._clock()
        with self._lock:
            view = self._views.get(key)
            return view is not None and any(d > now for d in view.expected.values())

    def moving(self, key: Key) -> bool:
        """Whether the job's status says a worker is moving (policy.notices)."""
        cached = self.job(key)
        return bool(cached is not None and cached.job is not None
                    and any(s.moving_from for s in cached.job.status.slots))

    def pollable(self, key: Key) -> bool:
        """Whether a progress poll of this job could reach anyone (probe.poll_progress asks the
        workers that answers_progress), or nothing is known of its pods yet."""
        with self._lock:
            view = self._views.get(key)
            if view is None:
                return True
            return any(rec.worker is not None and answers_progress(rec.worker)
                       for rec in view.pods.values())

    def orphans(self, key: Key) -> list[str] | None:
        """Pods still holding the finalizer for a job that is gone; None when none are known.
        Releasing re-reads each pod, so the watch's view is good enough to pick candidates."""
        with self._lock:
            view = self._views.get(key)
            if view is None:
                return None
            return sorted(n for n, rec in view.pods.items() if rec.finalizer)

    def refresh(self, key: Key, pods: list[Manifest], services: list[Manifest],
                token: Token) -> None:
        """Replace a job's view with a live observation begun at `token` (see begin()); a
        child the watch reported on after that keeps the watch's (newer) version."""
        records = {str(p["metadata"]["name"]): read_pod_record(p, key[1]) for p in pods}
        owners = {str(s["metadata"]["name"]): controller_uid(s) for s in services}
        with self._lock:
            view = self._views.setdefault(key, _View())
            newer = {n for n, seq in view.touched.items() if seq > token.seq}
            for name in newer:
                records.pop(name, None)
                owners.pop(name, None)
                if name in view.pods:
                    records[name] = view.pods[name]
                if name in view.services:
                    owners[name] = view.services[name]
            view.pods, view.services, view.expected = records, owners, {}
            view.touched = {n: view.touched[n] for n in newer}
            view.verified_epoch = token.epoch
            self._bump(key)

    def begin(self) -> Token:
        """Call before a live observation, hand the token to refresh() after it."""
        with self._lock:
            return Token(self._epoch, self._seq)

    def expect(self, key: Key, uid: str, names: list[str], since: Token) -> None:
        """Children of job `uid` just created (or found existing), by a round that began
        creating at `since`: wait to see them before trusting the view. Not for a job the watch
        has seen go (or replaced under its name): its children's events are no one's to wait
        for. Not for a child the watch reported on since: it was seen (or seen to go) already,
        and no later event of it may come."""
        deadline = self._clock() + EXPECTATION_SECONDS
        with self._lock:
            known = self._jobs.get(key)
            if known is None or known.raw["metadata"].get("uid") != uid:
                return
            view = self._views.setdefault(key, _View())
            for name in names:
                if name in view.pods or name in view.services \
                        or view.touched.get(name, -1) > since.seq:
                    continue
                view.expected[name] = deadline
            self._bump(key)
