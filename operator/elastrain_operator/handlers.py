"""kopf handler registrations, and nothing else: each notes which job needs a look.

They run on kopf's event loop and return at once; the operator's work queue (workqueue.py)
runs reconcile_if_needed() for the noted jobs on threads of its own:
- every watch event of a TrainingJob, and of a pod, Service or NetworkPolicy (when the operator
  renders them: watch_network_policies) labelled with a job's name, updates
  the in-memory view (k8s.cache); a change the planner can see queues the job as urgent (a
  deleted job's pods are released this way too);
- every watch event of a Node (when notices are on: watch_nodes) updates what the nodes say
  of their going (k8s.nodes); a change queues the jobs with a worker on that node;
- every watch event of a Kueue Workload, LocalQueue or ResourceFlavor (where Kueue is served:
  watch_kueue) updates what the operator knows of Kueue (k8s.kueue); a Workload's change
  queues the job that owns it;
- a ticker (one kopf daemon per live job, tickers.py) queues the job as routine every
  ELASTRAIN_TIMER_INTERVAL_SECONDS (and asks for the trainers' progress every
  ELASTRAIN_PROGRESS_INTERVAL_SECONDS): time-driven steps (backoff,
  deadlines, TTL, the hang watchdog) and anything the watch missed; a tick is dropped at once
  while an earlier check's finding "nothing due until T" still holds (reconcile.needs_round).
Under peering kopf pauses all of these on the replicas that are not active. A job's DELETED
event stops its ticker (kopf would not: tickers.py says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import random
import time
from typing import Any

import kopf

from elastrain_operator.model.names import LABEL_JOB
from elastrain_operator.model.spec import API_GROUP, API_VERSION, PLURAL
from elastrain_operator.reconcile import utcnow
from elastrain_operator.startup import (
    PROGRESS_INTERVAL_SECONDS,
    TIMER_INTERVAL_SECONDS,
    OperatorState,
    configure,
)

kopf.on.startup()(configure)


def _state(memo: Any) -> OperatorState:
    state: OperatorState = memo.state
    assert state.queue is not None, "the startup handler creates the queue"
    return state


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def on_job_event(*, type: str | None, body: kopf.Body, namespace: str | None, name: str,
                       memo: Any, **_: Any) -> None:
    state = _state(memo)
    assert namespace and state.queue
    key, uid = (namespace, name), str(body.get("metadata", {}).get("uid"))
    if type == "DELETED":
        state.tickers.job_gone(key, uid)
        state.cache.drop_job(key, uid)
        state.last_progress_poll.pop(uid, None)
        state.job_deleted(key, uid)
    else:
        state.tickers.job_seen(key, uid)
        if not state.cache.put_job(dict(body)):
            return
    state.queue.add(key, urgent=True)


async def _on_child_event(kind: str, type: str | None, body: kopf.Body, memo: Any) -> None:
    state = _state(memo)
    assert state.queue
    if type is None:
        state.cache.relisted()
    if type == "DELETED":
        key = state.cache.remove(kind, dict(body))
    elif kind == "pods":
        key = state.cache.put_pod(dict(body))
    else:
        key = state.cache.put_service(dict(body))
    if key is not None:
        state.queue.add(key, urgent=True)


@kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def on_owned_pod_event(*, type: str | None, body: kopf.Body, memo: Any,
                             **_: Any) -> None:
    await _on_child_event("pods", type, body, memo)


@kopf.on.event("v1", "services", labels={LABEL_JOB: kopf.PRESENT})
async def on_owned_service_event(*, type: str | None, body: kopf.Body, memo: Any,
                                 **_: Any) -> None:
    await _on_child_event("services", type, body, memo)


async def on_owned_network_policy_event(*, type: str | None, body: kopf.Body, memo: Any,
                                       **_: Any) -> None:
    await _on_child_event("networkpolicies", type, body, memo)


def watch_network_policies() -> None:
    """Registered only when jobs get NetworkPolicies (network_settings): an install that turns
    them off need not grant the operator any right on networkpolicies."""
    kopf.on.event("networking.k8s.io", "v1", "networkpolicies",
                  labels={LABEL_JOB: kopf.PRESENT})(on_owned_network_policy_event)


async def on_node_event(*, type: str | None, body: kopf.Body, name: str, memo: Any,
                        **_: Any) -> None:
    """What a node says of its going changed: every job with a worker on it plans again."""
    state = _state(memo)
    assert state.queue
    notices = state.notices
    if notices is None:
        return
    changed = notices.remove(name) if type == "DELETED" else notices.put(dict(body))
    if changed:
        for key in state.cache.jobs_on(name):
            state.queue.add(key, urgent=True)


def watch_nodes() -> None:
    """Registered only when notices are on and the operator may read nodes (k8s.nodes)."""
    kopf.on.event("", "v1", "nodes")(on_node_event)


async def on_workload_event(*, type: str | None, body: kopf.Body, memo: Any,
                            **_: Any) -> None:
    """A Kueue Workload changed: the TrainingJob that owns it plans again (its admission,
    an eviction, or its deletion's finalizer)."""
    state = _state(memo)
    assert state.queue and state.kueue
    obj = dict(body)
    key = state.kueue.remove_workload(obj) if type == "DELETED" else state.kueue.put_workload(obj)
    if key is not None:
        state.cache.stale(key)
        state.queue.add(key, urgent=True)
    for other in state.kueue.jobs_waited_on(obj):  # they may yield to it (policy.kueue_yield)
        state.queue.add(other, urgent=False)


async def on_local_queue_event(*, type: str | None, body: kopf.Body, memo: Any,
                               **_: Any) -> None:
    """Which namespaces have a LocalQueue named `default` (new jobs there are queued in it)."""
    state = _state(memo)
    assert state.kueue
    state.kueue.put_local_queue(dict(body), deleted=type == "DELETED")


async def on_cluster_queue_event(*, type: str | None, body: kopf.Body, memo: Any,
                                 **_: Any) -> None:
    """A ClusterQueue's preemption policy: whether Kueue preempts for a waiting Workload or a
    job may yield to it (policy.kueue_yield)."""
    state = _state(memo)
    assert state.kueue
    state.kueue.put_cluster_queue(dict(body), deleted=type == "DELETED")


async def on_resource_flavor_event(*, type: str | None, body: kopf.Body, memo: Any,
                                   **_: Any) -> None:
    state = _state(memo)
    assert state.kueue
    state.kueue.put_flavor(dict(body), deleted=type == "DELETED")


def watch_kueue(*, yielding: bool = False) -> None:
    """Registered only where the apiserver serves Kueue's v1beta2 API (k8s.kueue); the
    ClusterQueues only where jobs may yield quota (policy.kueue_yield)."""
    group, version = "kueue.x-k8s.io", "v1beta2"
    kopf.on.event(group, version, "workloads")(on_workload_event)
    kopf.on.event(group, version, "localqueues")(on_local_queue_event)
    kopf.on.event(group, version, "resourceflavors")(on_resource_flavor_event)
    if yielding:
        kopf.on.event(group, version, "clusterqueues")(on_cluster_queue_event)


# What pyproject.toml pins kopf to: the versions the tests ran.
KOPF_TESTED = ">=1.45,<1.46"


def _spawning(registry: kopf.OperatorRegistry) -> Any:
    if not hasattr(registry, "_spawning"):
        raise _missing_hook("OperatorRegistry._spawning")
    return registry._spawning


def _missing_hook(hook: str) -> RuntimeError:
    return RuntimeError(
        f"kopf {importlib.metadata.version('kopf')} has no {hook}, which elastrain needs to run "
        f"a ticker per job without a finalizer; elastrain is tested with kopf{KOPF_TESTED} "
        f"(pyproject.toml): install one of those")


def daemon_without_finalizer(fn: Any) -> Any:
    """@kopf.daemon on TrainingJobs, minus the finalizer kopf puts on every object a daemon runs
    for (so that the daemon stops before the object goes). Ours only queues checks; the
    finalizer cost a PATCH (and a watch event) per job created and another per job deleted,
    held every deletion while no operator ran, and made the TTL's own deletion wait for the
    daemon to exit. kopf has no switch for it, so the handler kopf.daemon builds is registered
    with requires_finalizer=False instead (kopf's private `_spawning`: the registry has no
    public way to add a built handler). Without the finalizer kopf never sees the deletion
    coming and does not stop the daemon: the job's DELETED event does (tickers.py).
    elastrain_trainer.private_hooks lists this with the trainer's private hooks; a kopf without
    them stops the operator at import with a message naming the hook and the tested kopf."""
    scratch = kopf.OperatorRegistry()
    # cancellation_timeout: kopf cancels the daemon's task at once when it stops it.
    kopf.daemon(API_GROUP, API_VERSION, PLURAL, cancellation_timeout=1.0, registry=scratch)(fn)
    (handler,) = _spawning(scratch).get_all_handlers()
    if "requires_finalizer" not in {f.name for f in dataclasses.fields(handler)}:
        raise _missing_hook(f"{type(handler).__name__}.requires_finalizer")
    _spawning(kopf.get_default_registry()).append(
        dataclasses.replace(handler, requires_finalizer=False))
    return fn


@daemon_without_finalizer
async def job_ticker(*, namespace: str | None, name: str, uid: str, memo: Any,
                     stopped: kopf.DaemonStopped, **_: Any) -> None:
    """One per live job (tickers.py), for as long as kopf runs handlers for it: it returns on
    the job's DELETED event, and kopf cancels it while peering pauses this replica and when
    the operator exits. A daemon rather than a kopf timer: a timer's tick goes through kopf's
    handler machinery (~2/3 of the idle operator's CPU at 1000 jobs, seen with py-spy), this
    loop's is one timed wait in this task (not stopped.wait(), which starts and cancels a task
    per tick). Ticks start at a random phase so that 1000 jobs created at once do not tick
    together."""
    state = _state(memo)
    key = (namespace or "", name)
    stop = state.tickers.start(key, uid)
    if stop is None:
        return  # the job is gone already (created and deleted before kopf spawned this)
    try:
        delay = random.uniform(0, TIMER_INTERVAL_SECONDS)
        while not stopped:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await stop.wait()
            if stop.is_set():
                return
            tick(state, key, uid)
            delay = TIMER_INTERVAL_SECONDS
    finally:
        state.tickers.finished(key, uid)


def tick(state: OperatorState, key: tuple[str, str], uid: str) -> None:
    assert state.queue
    now = time.monotonic()
    # A poll of a job with no Ready worker would ask nobody: skip it (and plan nothing) until
    # one is Ready, so 1000 pending or idle jobs cost no planning rounds. While a worker moves
    # (policy.notices), every tick polls: the old pod leaves once the poll sees its replacement
    # in the world's plan.
    interval = 0.0 if state.cache.moving(key) else PROGRESS_INTERVAL_SECONDS
    poll = now - state.last_progress_poll.get(uid, 0.0) >= interval \
        and state.cache.pollable(key)
    if poll:
        state.last_progress_poll[uid] = now
    elif state.cache.is_quiet(key, utcnow()):
        return  # nothing changed since a check found nothing due until past now
    state.queue.add(key, urgent=False, poll=poll)
