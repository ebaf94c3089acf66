"""Small policies: backoff math, budgets, TTL/deadline with an injected clock, conditions."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from elastrain_operator.model import conditions as c
from elastrain_operator.model.spec import (
    NAME_DNS_LABEL_MESSAGE,
    NAME_LENGTH_MESSAGE,
    NPROC_AUTO_MESSAGE,
    RestartPolicy,
    TrainingJob,
)
from elastrain_operator.model.status import TrainingJobStatus
from elastrain_operator.policy.restarts import backoff_seconds, backoff_until, exhausted_budget
from elastrain_operator.policy.status import make_condition, set_condition, transition_events
from elastrain_operator.policy.ttl import deadline_exceeded, ttl_expired
from elastrain_operator.policy.validation import validate
from elastrain_operator.render.crd import build_crd
from tests.unit.operator.test_planning import T0, started


@pytest.mark.parametrize(("restarts", "expected"), [(0, 0), (1, 10), (2, 20), (3, 40),
                                                    (4, 80), (5, 100), (500, 100)])
def test_backoff_doubles_up_to_the_cap(restarts: int, expected: int) -> None:
    policy = RestartPolicy(backoff_seconds=10, max_backoff_seconds=100)
    assert backoff_seconds(policy, restarts) == expected


def test_zero_backoff_means_no_wait() -> None:
    policy = RestartPolicy(backoff_seconds=0)
    assert backoff_until(policy, 3, T0) is None
    assert backoff_until(RestartPolicy(), 1, T0) == T0 + timedelta(seconds=10)


def test_budgets_allow_exactly_n() -> None:
    policy = RestartPolicy(max_restarts=2, max_preemptions=3)
    assert exhausted_budget(policy, restarts=2, preemptions=3) is None
    restarts = exhausted_budget(policy, restarts=3, preemptions=0)
    preemptions = exhausted_budget(policy, restarts=0, preemptions=4)
    assert restarts is not None and restarts[0] == c.MAX_RESTARTS_EXCEEDED
    assert preemptions is not None and preemptions[0] == c.MAX_PREEMPTIONS_EXCEEDED
    assert exhausted_budget(RestartPolicy(), restarts=0, preemptions=10**6) is None


def job(status: dict[str, Any] | None = None, **spec: Any) -> TrainingJob:
    return TrainingJob.model_validate({"metadata": {"name": "demo"},
                                       "spec": {"image": "i", **spec}, "status": status or {}})


def test_deadline_uses_start_time_and_the_injected_clock() -> None:
    j = job({"startTime": "2026-01-01T00:00:00Z"}, activeDeadlineSeconds=60)
    assert not deadline_exceeded(j, T0 + timedelta(seconds=59))
    assert deadline_exceeded(j, T0 + timedelta(seconds=60))
    assert not deadline_exceeded(job({"startTime": "2026-01-01T00:00:00Z"}), T0 + timedelta(days=9))
    assert not deadline_exceeded(job(activeDeadlineSeconds=1), T0 + timedelta(days=9))


def test_ttl_counts_from_completion_of_a_finished_job() -> None:
    done = {"phase": "Succeeded", "completionTime": "2026-01-01T00:00:00Z"}
    assert ttl_expired(job(done, ttlSecondsAfterFinished=0), T0)
    assert not ttl_expired(job(done, ttlSecondsAfterFinished=10), T0 + timedelta(seconds=9))
    assert not ttl_expired(job({**done, "phase": "Running"}, ttlSecondsAfterFinished=0), T0)
    assert not ttl_expired(job(done), T0 + timedelta(days=999))


def test_validation_repeats_the_crds_rules_with_their_messages() -> None:
    assert validate(job(nprocPerNode="auto", resources={"limits": {"nvidia.com/gpu": 1}})) == []
    assert validate(job(nprocPerNode="auto", resources={"requests": {"amd.com/gpu": 1}})) == []
    bad = TrainingJob.model_validate({"metadata": {"name": "9" + "x" * 60},
                                      "spec": {"image": "i", "nprocPerNode": "auto"}})
    problems = validate(bad)
    assert problems == [NAME_LENGTH_MESSAGE, NAME_DNS_LABEL_MESSAGE, NPROC_AUTO_MESSAGE]
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = [*schema["x-kubernetes-validations"],
             *schema["properties"]["spec"]["x-kubernetes-validations"]]
    assert set(problems) <= {r["message"] for r in rules}
    dotted = TrainingJob.model_validate({"metadata": {"name": "a.b"}, "spec": {"image": "i"}})
    assert validate(dotted) == [NAME_DNS_LABEL_MESSAGE]


def test_condition_keeps_transition_time_while_status_is_unchanged() -> None:
    later = T0 + timedelta(hours=1)
    first = make_condition(c.RUNNING, True, c.WORKERS_RUNNING, "2 of 2", now=T0, generation=1)
    again = make_condition(c.RUNNING, True, c.WORKERS_RUNNING, "1 of 2", now=later, generation=2)
    (kept,) = set_condition([first], again)
    assert kept.last_transition_time == T0 and kept.message == "1 of 2"
    assert kept.observed_generation == 2
    flipped = make_condition(c.RUNNING, False, c.BELOW_MIN_REPLICAS, "", now=later, generation=2)
    (changed,) = set_condition([first], flipped)
    assert changed.last_transition_time == later


def test_status_records_observed_generation_and_is_stable() -> None:
    w = started()
    w.job["metadata"]["generation"] = 7
    w.reconcile(T0 + timedelta(minutes=5))
    assert w.status["observedGeneration"] == 7
    assert all(x["observedGeneration"] == 7 for x in w.status["conditions"])
    running = w.condition(c.RUNNING)
    assert running["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    before = w.status
    p = w.reconcile(T0 + timedelta(minutes=9))
    assert p.status.to_api() == before and p.events == ()  # nothing changed: nothing to write


def test_events_announce_transitions_once() -> None:
    old = TrainingJobStatus()
    run = make_condition(c.RUNNING, True, c.WORKERS_RUNNING, "ok", now=T0, generation=1)
    new = old.model_copy(update={"conditions": [run]})
    (event,) = transition_events(old, new)
    assert (event.type, event.reason) == ("Normal", c.WORKERS_RUNNING)
    assert transition_events(new, new) == []
    lost = make_condition(c.RUNNING, False, c.BELOW_MIN_REPLICAS, "0 of 1", now=T0, generation=1)
    (warning,) = transition_events(new, old.model_copy(update={"conditions": [lost]}))
    assert warning.type == "Warning"

