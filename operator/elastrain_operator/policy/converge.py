"""Step 3 of a reconcile (policy.planning): converge the job's children on what it needs. The
Services, the NetworkPolicy (when the operator renders them: render.network), the rendezvous
store and one pod per active slot (those lost to the store after its backoff, or once it is
Ready); stale pods go; a terminal job keeps its finished pods for their logs.

The store goes only after the workers: a job stopped whole (a suspend, Kueue's eviction, a
scale to zero) deletes its workers first and its store once none of them runs, since the
workers' stop (in process: the stop generation and its save; torchrun agents: their group's
save) goes through the store, which a worker that finds it gone cannot reach.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from elastrain_operator.model import conditions as c
from elastrain_operator.model.names import store_name, worker_service_name
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import WorkerSlot
from elastrain_operator.policy.failures import Exit, classify_pod_exit
from elastrain_operator.policy.round import Observed, Round, current_pods
from elastrain_operator.policy.stale import Removal, lost_under, removal
from elastrain_operator.policy.status import EventSpec
from elastrain_operator.policy.store import StorePod, store_hold, unheard_for
from elastrain_operator.render.network import MetricsPeers, render_network_policy
from elastrain_operator.render.rendezvous import render_store_pod, render_store_service
from elastrain_operator.render.service import render_worker_service
from elastrain_operator.render.workers import render_worker_pod


def cleanup_stale(r: Round, observed: Observed, now: datetime) -> None:
    current = current_pods(r.acct.slots, observed.workers)
    moving = {s.moving_from for s in r.acct.slots if s.moving_from}  # policy.notices' own
    for pod in observed.workers:
        if current.get(pod.index) is pod or pod.name in moving:
            continue
        how = removal(pod, observed.lost_nodes, now)
        if how is Removal.FORCE:
            r.force_delete_pods.append(pod.name)
        elif how is Removal.DELETE:
            r.delete_pods.append(pod.name)
        if pod.has_finalizer:
            r.release_pods.append(pod.name)


def finish(r: Round, job: TrainingJob, observed: Observed) -> None:
    """A terminal job keeps finished pods for their logs, deletes the rest, counts nothing."""
    for pod in observed.workers:
        if not pod.deleting and classify_pod_exit(pod) in (Exit.RUNNING, Exit.PENDING):
            r.delete_pods.append(pod.name)
        if pod.has_finalizer:
            r.release_pods.append(pod.name)
    if observed.store is not None and not observed.store.deleting:
        r.delete_pods.append(store_name(job.metadata.name))


def _replace_lost_store(r: Round, store: StorePod, name: str, why: str) -> None:
    """The store pod's node is lost (NotReady, unreachable): force-delete the pod (a graceful
    delete would wait for a kubelet that does not answer, and its node-loss toleration would
    keep it for as long) so the next round creates it on a live node. The trainers train on
    meanwhile: in process a world reclaims an empty store (docs/recovery.md section 7); torchrun
    agents lose their rendezvous and are replaced, as on any store loss."""
    r.force_delete_pods.append(store_name(name))
    if not store.deleting:
        r.events.append(EventSpec(
            "Warning", c.STORE_LOST,
            f"the rendezvous store pod's node {store.node} is lost ({why}): the pod is "
            "force-deleted and created again on a live node"))


def _replace_unheard_store(r: Round, store: StorePod, name: str, unheard: float) -> None:
    """No trainer has heard the store pod (policy.store.unheard_for): force-delete it (its
    kubelet may not answer, and the next pod takes its name) and keep the next one off its
    node, which may still read Ready."""
    r.force_delete_pods.append(store_name(name))
    if r.acct.store is not None:
        r.acct = replace(r.acct, store=r.acct.store.model_copy(update={"unheard_on": store.node}))
    r.events.append(EventSpec(
        "Warning", c.STORE_LOST,
        f"no trainer has heard the rendezvous store pod (on node {store.node or 'unknown'}) for "
        f"{unheard:.0f} s (its node dark or its process frozen): the pod is force-deleted and "
        "created again, on another node where one takes it"))


def converge(r: Round, job: TrainingJob, observed: Observed, *, pods: int,
              finishing: bool, network: MetricsPeers | None,
              now: datetime) -> tuple[bool, bool, datetime | None]:
    """Create what is missing; returns (created anything, waiting for a backoff, waiting for
    the store until)."""
    name = job.metadata.name
    created = False
    for service, render in ((worker_service_name(name), render_worker_service),
                            (store_name(name), render_store_service)):
        if service not in observed.services:
            r.create.append(render(job))
            created = True
    # Before any pod, so no pod of the job runs unprotected by the enforcer.
    if network is not None and not observed.network_policy:
        r.create.append(render_network_policy(job, network))
    store = observed.store
    if pods and store is None:
        unheard_on = r.acct.store.unheard_on if r.acct.store is not None else None
        r.create.append(render_store_pod(job, avoid=unheard_on or ""))
        created = True
    elif store is not None and (lost := lost_under(store.created, store.node,
                                                    observed.lost_nodes, observed.lost_since)):
        _replace_lost_store(r, store, name, lost)
    elif store is not None and job.spec.in_process and (unheard := unheard_for(
            observed.progress, store, r.acct.store, job.spec.recovery.heartbeat_timeout_seconds,
            now=now)) is not None:
        _replace_unheard_store(r, store, name, unheard)
    elif store is not None and not store.deleting and (
            (not pods and not _workers_run(observed))
            or store.phase in ("Failed", "Succeeded")):
        r.delete_pods.append(store_name(name))
    in_backoff, held = False, None
    hold = store_hold(r.acct.store, now=now)
    current = current_pods(r.acct.slots, observed.workers)
    for slot in r.acct.slots[:pods] if not finishing else ():
        if slot.index in current:
            continue
        if slot.replace_after is not None and now < slot.replace_after:
            in_backoff = True
            continue
        if hold is not None:
            held = hold
            continue
        r.create.append(render_worker_pod(job, slot.index, slot.attempt))
        created = True
    return created, in_backoff, held


def ensure_slots(r: Round, pods: int) -> None:
    have = {s.index for s in r.acct.slots}
    extra = [WorkerSlot(index=i) for i in range(pods) if i not in have]
    if extra:
        r.acct = replace(r.acct, slots=tuple(sorted((*r.acct.slots, *extra),
                                                    key=lambda s: s.index)))


def _workers_run(observed: Observed) -> bool:
    """A worker pod of the job still runs (or may: pending), deleted or not: a pod being
    deleted runs its trainer's stop until its container ends (classify_pod_exit calls it
    preempted as soon as it is deleted)."""
    return any(p.phase not in ("Succeeded", "Failed") for p in observed.workers)
