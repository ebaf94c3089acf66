"""kopf handler registrations, and nothing else: each one calls reconcile_once().

- create/update/resume of a TrainingJob;
- a timer that re-checks actual state every ELASTRAIN_TIMER_INTERVAL_SECONDS (and polls the
  trainers' progress every ELASTRAIN_PROGRESS_INTERVAL_SECONDS);
- every event of a pod labelled with a job's name triggers that job's reconcile (workers and
  stores are owned pods; a deleted job's pods are released this way too).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import kopf

from elastrain_operator.k8s.client import Kube
from elastrain_operator.model.names import LABEL_JOB
from elastrain_operator.model.spec import API_GROUP, API_VERSION, PLURAL
from elastrain_operator.reconcile import JobGate, Options, reconcile_once
from elastrain_operator.startup import (
    HANDLER_BACKOFF_SECONDS,
    PROGRESS_INTERVAL_SECONDS,
    TIMER_INTERVAL_SECONDS,
    OperatorState,
    configure,
)

GATE = JobGate()
kopf.on.startup()(configure)


def _kube(memo: Any) -> Kube:
    state: OperatorState = memo.state
    assert state.kube is not None, "the startup handler creates the client"
    return state.kube


def _run(memo: Any, namespace: str | None, name: str, *, poll: bool = False) -> None:
    assert namespace, "TrainingJobs and pods are namespaced"
    kube = _kube(memo)
    GATE.run((namespace, name),
             lambda: reconcile_once(kube, namespace, name, Options(poll_progress=poll)))


@kopf.on.resume(API_GROUP, API_VERSION, PLURAL, backoff=HANDLER_BACKOFF_SECONDS)
@kopf.on.create(API_GROUP, API_VERSION, PLURAL, backoff=HANDLER_BACKOFF_SECONDS)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL, backoff=HANDLER_BACKOFF_SECONDS)
def on_job_change(*, namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    _run(memo, namespace, name)


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=TIMER_INTERVAL_SECONDS, sharp=False)
def on_timer(*, namespace: str | None, name: str, uid: str, memo: Any, **_: Any) -> None:
    state: OperatorState = memo.state
    now = time.monotonic()
    poll = now - state.last_progress_poll.get(uid, 0.0) >= PROGRESS_INTERVAL_SECONDS
    if poll:
        state.last_progress_poll[uid] = now
    _run(memo, namespace, name, poll=poll)


@kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
def on_owned_pod_event(*, namespace: str | None, labels: Mapping[str, str], memo: Any,
                       **_: Any) -> None:
    _run(memo, namespace, labels[LABEL_JOB])
