"""One reconcile of one TrainingJob: parse -> observe -> plan -> write status -> apply -> events.

Every trigger (a watch event of the job or of one of its children, the job's ticker) first asks
needs_round(): the same plan, made from the watch-fed view (k8s.cache) without a request to the
apiserver; only when that plan would change something does reconcile_once() run. It starts from
the watch's copy of the job (the status carries the accounting), observes the children from the
view when it can be trusted (else live), and writes the status with the job's resourceVersion,
so a restarted operator picks up exactly where the cluster says things are. A status write that
loses a race (409, or 404: the job is gone) makes the round start over from a fresh read.

In-process, concurrent triggers for the same job are coalesced by JobGate: one round runs at a
time per job, and triggers that arrive meanwhile make it run once more. Across processes kopf
peering keeps a single active replica, and the status write's optimistic lock keeps counting
exact even if two ever overlap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError

from elastrain_operator import metrics
from elastrain_operator.control import job_token
from elastrain_operator.k8s.apply import (
    StatusConflict,
    apply_children,
    create_child,
    delete_job,
    release_pod,
    write_status,
)
from elastrain_operator.k8s.cache import Cache, Key
from elastrain_operator.k8s.client import Kube, KubeError, Manifest
from elastrain_operator.k8s.events import post_events
from elastrain_operator.k8s.kueue import (
    KueueState,
    create_workload,
    delete_workload,
    label_queue,
    patch_workload,
    patch_workload_status,
    release_workload,
)
from elastrain_operator.k8s.nodes import NodeNotices
from elastrain_operator.k8s.observe import observe, orphaned_pods, read_job
from elastrain_operator.model import conditions as c
from elastrain_operator.model.names import LABEL_ROLE, ROLE_WORKER
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import TrainingJobStatus
from elastrain_operator.policy.kueue_grow import ExtraWrite
from elastrain_operator.policy.kueue_slices import SliceWrite
from elastrain_operator.policy.planning import Plan, plan
from elastrain_operator.policy.progress import ProgressReport
from elastrain_operator.policy.round import Observed
from elastrain_operator.policy.status import EventSpec, make_condition, set_condition
from elastrain_operator.probe import poll_progress, told_lost, told_moving, told_replicas
from elastrain_operator.render.control import controlled, render_control_secret
from elastrain_operator.render.network import MetricsPeers

log = logging.getLogger(__name__)
ROUNDS = 4  # the watch's copy, then a fresh read per lost status race; then wait for a trigger
# How far ahead a check that found nothing looks, farthest first: a job quiet for 5 minutes
# is planned again (by its ticker) once per 5 minutes, not every tick.
QUIET_HORIZONS_SECONDS = (300.0, 60.0, 15.0)


def utcnow() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


@dataclass(frozen=True)
class Options:
    poll_progress: bool = False
    progress: tuple[ProgressReport, ...] | None = None  # already polled: use, do not poll again
    clock: Callable[[], datetime] = utcnow
    cache: Cache | None = None  # the watch-fed view; None: observe everything live
    network: MetricsPeers | None = None  # each job gets its NetworkPolicy; None: no policies
    control_key: bytes | None = None  # the operator's (control.py); None: no control channel
    notices: NodeNotices | None = None  # what nodes say of their going; None: not read
    notices_off: str = ""  # why not, when the operator was asked to read them
    kueue: KueueState | None = None  # the jobs' Workloads (k8s.kueue); None: Kueue not read


def control_token(options: Options, job: TrainingJob) -> str | None:
    """The job's control token, for a job the operator steers while it runs."""
    if options.control_key is None or not controlled(job):
        return None
    return job_token(options.control_key, job.metadata.uid)


def with_notices(observed: Observed, options: Options) -> Observed:
    """The notices of the nodes the job's workers run on (policy.notices), and which of them
    and of its store pod's node are lost (policy.stale, policy.planning)."""
    if options.notices is None:
        return replace(observed, notices_off=options.notices_off) if options.notices_off \
            else observed
    nodes = {w.node for w in observed.workers if w.node}
    store = {observed.store.node} if observed.store is not None and observed.store.node else set()
    return replace(observed, notices=options.notices.of(nodes),
                   lost_nodes=options.notices.lost_of(nodes | store),
                   lost_since=options.notices.lost_since_of(nodes | store))


def with_kueue(observed: Observed, job: TrainingJob, options: Options,
               kube: Kube | None) -> Observed:
    """The job's Kueue Workload and queue (policy.kueue), when Kueue queues it. `kube` None:
    from the watches alone."""
    if options.kueue is None:
        return observed
    return replace(observed, kueue=options.kueue.view(kube, job))


def has_work(p: Plan, job: TrainingJob, orphans: tuple[str, ...]) -> bool:
    """Whether applying the plan would change anything in the cluster."""
    return bool(p.status != job.status or p.create or p.delete_pods or p.force_delete_pods
                or p.release_pods or p.delete_job or p.events or orphans
                or p.create_workload or p.workload.status or p.workload.spec
                or p.workload.unfinalize
                or p.workload.label_queue or p.workload.extra != ExtraWrite()
                or p.workload.slices != SliceWrite())


def needs_round(cache: Cache, key: Key, options: Options) -> tuple[bool, Options]:
    """Plan from the watch-fed view alone (no request, bar a due progress poll): is a
    reconcile_once() needed? Also returns its options, carrying the progress polled here."""
    cached = cache.job(key)
    if cached is None:  # deleted (or not seen yet: its own event will come)
        return bool(cache.orphans(key)), options
    if cached.job is None:
        return True, options  # unparseable: the round reports it (and writes nothing twice)
    if cache.waiting(key):
        return False, options  # our own creations are on their way; their events re-trigger
    now, signature = options.clock(), cache.signature(key)
    if not options.poll_progress and cache.is_quiet(key, now):
        return False, options
    children = cache.children(key, cached.job.metadata.uid)
    if children is None:
        return True, options
    observed = with_kueue(with_notices(children.observed, options), cached.job, options, None)
    if options.poll_progress:
        spec = cached.job.spec
        observed = replace(observed, progress=poll_progress(
            observed.workers, spec.metrics_port, told_replicas(spec, cached.job.status),
            token=control_token(options, cached.job), moving=told_moving(cached.job.status),
            lost=told_lost(observed.workers, observed.lost_nodes, observed.lost_since)))
        options = replace(options, progress=observed.progress, poll_progress=False)
    if has_work(plan(cached.job, observed, now=now, network=options.network), cached.job,
                children.orphans):
        return True, options
    if observed.progress is None:
        # Time alone only ever makes steps due (a backoff ends, a deadline or TTL passes),
        # never undue: nothing due at `now` nor at `later` means nothing due in between, so
        # the ticker's next ticks need not plan again until the inputs change or `later`.
        for horizon in QUIET_HORIZONS_SECONDS:
            later = now + timedelta(seconds=horizon)
            if not has_work(plan(cached.job, observed, now=later, network=options.network),
                            cached.job, children.orphans):
                cache.set_quiet(key, signature, later)
                break
    return False, options


def reconcile_if_needed(kube: Kube, key: Key, options: Options) -> str | None:
    """What every trigger runs: the cheap check, then a round when it found work."""
    if options.cache is not None:
        needed, options = needs_round(options.cache, key, options)
        if not needed:
            return None
    return reconcile_once(kube, key[0], key[1], options)


def reconcile_once(kube: Kube, namespace: str, name: str, options: Options = Options()) -> str:
    """Bring one job's children and status in line with its spec; returns the result label."""
    started = time.monotonic()
    result = "error"
    try:
        result = _reconcile(kube, namespace, name, options)
        return result
    finally:
        metrics.record_reconcile(result, time.monotonic() - started)


def _reconcile(kube: Kube, namespace: str, name: str, options: Options) -> str:
    # The first round starts from the watch's copy of the job, as informer-fed controllers do:
    # the status write carries its resourceVersion, so a stale copy loses that race (409, or
    # 404 for a job deleted since) and the next round reads the job fresh. Saves a GET per
    # round, a seventh of the operator's requests while 1000 new jobs get their children.
    cached = options.cache.job((namespace, name)) if options.cache is not None else None
    # What the first round polled: a round that loses the status race must not lose it (a
    # trainer that gave up at start serves its reason until one poll read it, then exits).
    polled: list[tuple[ProgressReport, ...]] = []
    for attempt in range(ROUNDS):
        raw = cached.raw if attempt == 0 and cached is not None \
            else read_job(kube, namespace, name)
        if raw is None:
            for pod in orphaned_pods(kube, namespace, name, options.cache):
                release_pod(kube, namespace, pod)
            for workload in options.kueue.orphans((namespace, name)) if options.kueue else ():
                release_workload(kube, workload)
            return "success"
        now = options.clock()
        try:
            job = TrainingJob.model_validate(raw)
        except ValidationError as err:
            _report_unparseable(kube, raw, err, now)
            return "success"
        try:
            _round(kube, raw, job, options, now, polled)
            return "success"
        except StatusConflict:
            log.debug("status of %s/%s changed under us; reading it again", namespace, name)
    return "conflict"


def _round(kube: Kube, raw: Manifest, job: TrainingJob, options: Options,
           now: datetime, polled: list[tuple[ProgressReport, ...]]) -> None:
    ns = job.metadata.namespace
    children = observe(kube, job, options.cache, network_policy=options.network is not None)
    observed = with_kueue(with_notices(children.observed, options), job, options, kube)
    if options.progress is not None:
        observed = replace(observed, progress=options.progress)
    elif options.poll_progress:
        if not polled:
            polled.append(poll_progress(observed.workers, job.spec.metrics_port,
                                        told_replicas(job.spec, job.status),
                                        token=control_token(options, job),
                                        moving=told_moving(job.status),
                                        lost=told_lost(observed.workers,
                                                       observed.lost_nodes)))
        observed = replace(observed, progress=polled[0])
    p = plan(job, observed, now=now, network=options.network)
    if p.status != job.status:
        written = write_status(kube, raw, p.status)
        if options.cache is not None and written:
            # The next check plans from it.
            options.cache.put_job(written, written_over=raw["metadata"].get("resourceVersion"))
        _tell_new_moves(job, p.status, observed, control_token(options, job))
    _apply_workload(kube, job, p, observed)
    since = options.cache.begin() if options.cache is not None else None
    secret_errors = _ensure_control_secret(kube, job, p.create, control_token(options, job))
    applied = apply_children(kube, ns, delete=p.delete_pods, force_delete=p.force_delete_pods,
                             release=p.release_pods + children.orphans, create=p.create)
    if options.cache is not None and since is not None:
        options.cache.expect((ns, job.metadata.name), job.metadata.uid, list(applied.present),
                             since)
    if p.delete_job:
        delete_job(kube, ns, job.metadata.name)
    events = list(p.events) + [EventSpec("Warning", c.CREATE_FAILED, e)
                               for e in secret_errors + applied.create_errors]
    post_events(kube, raw, events, now)
    metrics.record_workers_created(applied.workers_created)
    metrics.record_losses(restarts=p.counted_restarts, preemptions=p.counted_preemptions)
    if p.hung:
        metrics.record_hang()
    if p.recovered_after_seconds is not None:
        metrics.record_recovery(p.recovered_after_seconds)
    if p.training_recovery is not None:
        metrics.record_training_recovery(p.training_recovery.seconds)
    metrics.record_job(job.metadata.uid, None if p.delete_job else p.status.phase,
                       desired=p.status.replicas, ready=p.status.ready_replicas)
    if p.create or p.delete_pods or p.counted_restarts or p.counted_preemptions:
        log.info("reconciled %s/%s: phase=%s created=%d deleted=%d restarts=%d preemptions=%d",
                 ns, job.metadata.name, p.status.phase, len(p.create), len(p.delete_pods),
                 p.status.restarts, p.status.preemptions)


def _tell_new_moves(job: TrainingJob, status: TrainingJobStatus, observed: Observed,
                    token: str | None) -> None:
    """A move that started this round is told to the trainers at once, not at the next poll:
    a drain seconds after the notice must find the old pod's trainer knowing it moves (it then
    trains on until a node can take its place, inprocess.hold)."""
    moving = told_moving(status)
    if token is not None and set(moving) - set(told_moving(job.status)):
        poll_progress(observed.workers, job.spec.metrics_port,
                      told_replicas(job.spec, status), token=token, moving=moving,
                      lost=told_lost(observed.workers, observed.lost_nodes, observed.lost_since))


def _apply_workload(kube: Kube, job: TrainingJob, p: Plan, observed: Observed) -> None:
    """The round's Workload changes (policy.kueue), after the status that records them."""
    workload = observed.kueue.workload if observed.kueue is not None else None
    if p.workload.label_queue is not None:
        label_queue(kube, job.metadata.namespace, job.metadata.name, p.workload.label_queue)
    if p.create_workload is not None:
        create_workload(kube, p.create_workload)
    if workload is not None and p.workload.status is not None:
        patch_workload_status(kube, workload, p.workload.status)
    elif workload is not None and p.workload.spec is not None:
        # Not with a status patch in the same round: each is guarded by the version read.
        patch_workload(kube, workload, p.workload.spec)
    if workload is not None and p.workload.unfinalize:
        release_workload(kube, workload)
    extra, more = p.workload.extra, observed.kueue.extra if observed.kueue is not None else None
    if extra.create is not None:
        create_workload(kube, extra.create)
    if more is not None and extra.status is not None:
        patch_workload_status(kube, more, extra.status)
    elif more is not None and extra.delete:
        delete_workload(kube, more)
    slices = p.workload.slices
    if slices.create is not None:
        create_workload(kube, slices.create)
    for old in slices.release:  # before a delete: each is guarded by the version read
        release_workload(kube, old)
    for old in slices.delete:
        if old not in slices.release:
            delete_workload(kube, old)


def _report_unparseable(kube: Kube, raw: Manifest, err: ValidationError, now: datetime) -> None:
    """The apiserver accepted what our model refuses: say so in status, never crash-loop."""
    try:
        status = TrainingJobStatus.model_validate(raw.get("status") or {})
    except ValidationError:
        status = TrainingJobStatus()
    message = "; ".join(f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                        for e in err.errors())[:2000]
    generation = int(raw["metadata"].get("generation", 0))
    new = status.model_copy(update={
        "conditions": set_condition(status.conditions, make_condition(
            c.VALID, False, c.INVALID_SPEC, message, now=now, generation=generation)),
        "observed_generation": generation})
    if new != status:
        try:
            write_status(kube, raw, new)
        except StatusConflict:
            return
        post_events(kube, raw, [EventSpec("Warning", c.INVALID_SPEC, message)], now)


def _ensure_control_secret(kube: Kube, job: TrainingJob, create: tuple[Manifest, ...],
                           token: str | None) -> tuple[str, ...]:
    """The job's control Secret, before any worker pod that mounts it: created with each round
    that creates workers (one request; it already exists but the first time), never read or
    changed (the operator may create Secrets, not read or update them). Not watched, so never
    expected in the cache."""
    if token is None or not any(m["kind"] == "Pod" and m["metadata"]["labels"].get(LABEL_ROLE)
                                == ROLE_WORKER for m in create):
        return ()
    secret = render_control_secret(job, token)
    try:
        create_child(kube, secret)
    except KubeError as err:
        log.warning("creating %s failed: %s", secret["metadata"]["name"], err)
        return (f"Secret {secret['metadata']['name']}: {err}",)
    return ()


class JobGate:
    """Coalesce concurrent triggers per job: one round at a time, one more if any arrived."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[tuple[str, str]] = set()
        self._dirty: set[tuple[str, str]] = set()

    def run(self, key: tuple[str, str], fn: Callable[[], object]) -> bool:
        """Run fn now, or mark it to run again by whoever is running it; True if we ran it."""
        with self._lock:
            if key in self._running:
                self._dirty.add(key)
                return False
            self._running.add(key)
        try:
            while True:
                fn()
                with self._lock:  # leave in the same critical section that checks for more
                    if key not in self._dirty:
                        self._running.discard(key)
                        return True
                    self._dirty.discard(key)
        except BaseException:
            with self._lock:
                self._running.discard(key)
                self._dirty.discard(key)
            raise
