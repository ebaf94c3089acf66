"""The watch-fed view (k8s.cache) and the work queue: what a reconcile may trust, in what order
jobs are looked at."""

from __future__ import annotations

import copy
import threading
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest.mock import ANY

from elastrain_operator.k8s.cache import Cache
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.policy.planning import plan
from elastrain_operator.reconcile import Options, needs_round
from elastrain_operator.render.rendezvous import render_store_pod, render_store_service
from elastrain_operator.render.service import render_worker_service
from elastrain_operator.render.workers import render_worker_pod
from elastrain_operator.workqueue import WorkQueue

KEY = ("ml", "demo")
NOW = datetime(2026, 1, 1, tzinfo=UTC)
ANY_OPTIONS = ANY


def job(uid: str = "u1") -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": "demo", "namespace": "ml", "uid": uid},
        "spec": {"image": "img", "replicas": 2}})


def pod(index: int = 0, *, uid: str = "u1", unschedulable: str = "", deleting: bool = False,
        phase: str = "Pending") -> dict[str, Any]:
    manifest = copy.deepcopy(render_worker_pod(job(uid), index, 0))
    manifest["metadata"]["resourceVersion"] = "1"
    status: dict[str, Any] = {"phase": phase}
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False",
                                 "reason": "Unschedulable", "message": "0/1 nodes",
                                 "lastTransitionTime": unschedulable}]
    manifest["status"] = status
    if deleting:
        manifest["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return manifest


def trusted_cache() -> Cache:
    cache = Cache()
    cache.refresh(KEY, [pod(0), pod(1)], [render_worker_service(job())], cache.begin())
    return cache


def test_only_changes_the_planner_reads_wake_the_job() -> None:
    cache = trusted_cache()
    assert cache.put_pod(pod(0, unschedulable="t1")) == KEY  # now unschedulable: news
    assert cache.put_pod(pod(0, unschedulable="t2")) is None  # a scheduler retry: nothing new
    assert cache.put_pod(pod(0, phase="Running", unschedulable="t2")) == KEY


def test_the_view_is_trusted_only_after_a_live_read_since_the_last_relist() -> None:
    cache = Cache()
    cache.put_pod(pod(0))
    assert cache.children(KEY, "u1") is None  # never read live
    cache.refresh(KEY, [pod(0)], [], cache.begin())
    seen = cache.children(KEY, "u1")
    assert seen is not None and [w.index for w in seen.observed.workers] == [0]
    cache.relisted()  # a re-list says what exists, not what vanished meanwhile
    assert cache.children(KEY, "u1") is None
    token = cache.begin()
    cache.relisted()  # a re-list during the live read: that read is not enough either
    cache.refresh(KEY, [pod(0)], [], token)
    assert cache.children(KEY, "u1") is None


def raw_job(uid: str = "u1", version: str = "1") -> dict[str, Any]:
    return {"apiVersion": "elastrain.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "demo", "namespace": "ml", "uid": uid,
                         "resourceVersion": version, "generation": 1},
            "spec": {"image": "img", "replicas": 2}}


def test_own_creations_must_be_seen_before_the_view_is_trusted() -> None:
    now = [100.0]
    cache = Cache(clock=lambda: now[0])
    cache.put_job(raw_job())
    cache.refresh(KEY, [pod(0)], [], cache.begin())
    cache.expect(KEY, "u1", ["demo-worker-0-0", pod(1)["metadata"]["name"]],
                 cache.begin())  # the first is known
    assert cache.waiting(KEY) and cache.children(KEY, "u1") is None
    cache.put_pod(pod(1))
    assert not cache.waiting(KEY) and cache.children(KEY, "u1") is not None
    cache.expect(KEY, "u1", ["never-seen"], cache.begin())
    now[0] += 31  # given up waiting: not trusted until a live read settles it
    assert not cache.waiting(KEY) and cache.children(KEY, "u1") is None


def test_a_child_seen_come_and_go_while_its_round_created_is_not_waited_for() -> None:
    # A round creates a child; the watch reports it and then its deletion (a job deleted
    # meanwhile: the garbage collector takes its children at once) before the round gets to
    # say what it created. No later event of that child comes: waiting for one held the job.
    cache = Cache()
    cache.put_job(raw_job())
    cache.refresh(KEY, [], [], cache.begin())
    since = cache.begin()
    cache.put_pod(pod(0))
    cache.remove("pods", pod(0))
    cache.expect(KEY, "u1", [pod(0)["metadata"]["name"], pod(1)["metadata"]["name"]], since)
    cache.put_pod(pod(1))
    assert not cache.waiting(KEY)


def test_a_deleted_jobs_creations_never_hold_a_job_re_created_under_its_name() -> None:
    # The CI failure (test_deleted_jobs churn): the round of a job deleted while it created
    # left its children expected, and the job re-created under the name was not looked at
    # for 30 s. Both orders of the DELETED event and the round's end:
    cache = Cache()
    cache.put_job(raw_job("old"))
    since = cache.begin()
    cache.expect(KEY, "old", ["demo-rdzv"], since)  # the round ends first ...
    assert cache.waiting(KEY)
    cache.drop_job(KEY, "old")  # ... then the watch says the job went
    cache.put_job(raw_job("new", "5"))
    assert not cache.waiting(KEY)
    assert needs_round(cache, KEY, Options(clock=lambda: NOW))[0]

    cache = Cache()
    cache.put_job(raw_job("old"))
    since = cache.begin()
    cache.drop_job(KEY, "old")  # the watch first ...
    cache.put_job(raw_job("new", "5"))
    cache.expect(KEY, "old", ["demo-rdzv"], since)  # ... then the old job's round ends
    assert not cache.waiting(KEY)
    assert needs_round(cache, KEY, Options(clock=lambda: NOW))[0]


def test_a_status_write_never_puts_back_a_job_the_watch_saw_go() -> None:
    cache = Cache()
    cache.put_job(raw_job("old"))
    cache.drop_job(KEY, "old")
    assert not cache.put_job(raw_job("old", "2"), written_over="1")
    assert cache.job(KEY) is None
    cache.put_job(raw_job("new", "5"))
    assert not cache.put_job(raw_job("old", "3"), written_over="5")
    assert cache.job(KEY).raw["metadata"]["uid"] == "new"  # type: ignore[union-attr]
    assert cache.put_job(raw_job("new", "6"), written_over="5")
    assert cache.job(KEY).raw["metadata"]["resourceVersion"] == "6"  # type: ignore[union-attr]


def test_a_status_write_never_puts_back_a_job_older_than_the_watch_has_seen() -> None:
    """Our status write (over version 1) returned version 2; before this thread put it in the
    cache, the watch brought 2 and then 3 (the spec patched the moment our status showed, as
    CI saw in test_kueue_admission): 3 stays, or that spec change is never planned for."""
    cache = Cache()
    cache.put_job(raw_job("u1", "1"))
    cache.put_job(raw_job("u1", "2"))
    newer = raw_job("u1", "3")
    newer["spec"]["replicas"] = 3
    cache.put_job(newer)
    assert not cache.put_job(raw_job("u1", "2"), written_over="1")
    assert cache.job(KEY).raw["spec"]["replicas"] == 3  # type: ignore[union-attr]
    # Its own event already in: nothing to do either.
    cache.put_job(raw_job("u1", "4"))
    assert not cache.put_job(raw_job("u1", "4"), written_over="3")


def test_a_live_read_never_overwrites_newer_watch_events() -> None:
    cache = trusted_cache()
    token = cache.begin()  # the live read starts ...
    cache.put_pod(pod(0, deleting=True))  # ... the watch reports a deletion ...
    cache.remove("pods", pod(1))  # ... and a pod gone ...
    cache.refresh(KEY, [pod(0), pod(1)], [], token)  # ... the read, older, still has both
    seen = cache.children(KEY, "u1")
    assert seen is not None
    assert [(w.index, w.deleting) for w in seen.observed.workers] == [(0, True)]


def test_children_split_by_owner_uid() -> None:
    cache = Cache()
    cache.refresh(KEY, [pod(0), pod(1, uid="old")],
                  [render_worker_service(job()), render_store_service(job("old"))],
                  cache.begin())
    seen = cache.children(KEY, "u1")
    assert seen is not None
    assert [w.index for w in seen.observed.workers] == [0]
    assert seen.orphans == (pod(1, uid="old")["metadata"]["name"],)
    assert seen.observed.services == {"demo-workers"}
    assert seen.observed.foreign_services == {"demo-rdzv"}


def test_queue_merges_triggers_and_puts_urgent_work_first() -> None:
    handled: list[tuple[tuple[str, str], bool]] = []
    done = threading.Event()

    def handle(key: tuple[str, str], poll: bool) -> None:
        handled.append((key, poll))
        if len(handled) == 3:
            done.set()

    queue = WorkQueue(handle, workers=1, retry_seconds=0.0)
    queue.add(("ns", "a"), urgent=False)
    queue.add(("ns", "b"), urgent=False, poll=True)
    queue.add(("ns", "a"), urgent=False, poll=True)  # merged into the queued one
    queue.add(("ns", "c"), urgent=True)
    assert queue.depth() == 3
    queue.start()
    assert done.wait(10)
    queue.stop()
    assert handled == [(("ns", "c"), False), (("ns", "a"), True), (("ns", "b"), True)]


def test_queue_retries_a_failed_handler() -> None:
    calls: list[int] = []
    done = threading.Event()

    def handle(key: tuple[str, str], poll: bool) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("apiserver said no")
        done.set()

    queue = WorkQueue(handle, workers=1, retry_seconds=0.0)
    queue.start()
    queue.add(("ns", "a"), urgent=True)
    assert done.wait(10)
    queue.stop()
    assert len(calls) == 2


def steady(cache: Cache, **spec: Any) -> TrainingJob:
    """A job whose status is what planning its trusted view at NOW yields: nothing to do."""
    raw: dict[str, Any] = {"apiVersion": "elastrain.dev/v1alpha1", "kind": "TrainingJob",
                           "metadata": {"name": "demo", "namespace": "ml", "uid": "u1",
                                        "resourceVersion": "1", "generation": 1},
                           "spec": {"image": "img", "replicas": 2, **spec}}
    cache.put_job(raw)
    first = needs_round(cache, KEY, Options(clock=lambda: NOW))
    assert first[0], "a new job needs a round"
    parsed = TrainingJob.model_validate(raw)
    pods = [render_worker_pod(parsed, i, 0) | {"status": {"phase": "Running"}} for i in (0, 1)]
    cache.refresh(KEY, [*pods, render_store_pod(parsed) | {"status": {"phase": "Running"}}],
                  [render_worker_service(parsed), render_store_service(parsed)], cache.begin())
    status = plan(parsed, cache.children(KEY, "u1").observed, now=NOW).status  # type: ignore[union-attr]
    cache.put_job(raw | {"metadata": raw["metadata"] | {"resourceVersion": "2"},
                         "status": status.to_api()})
    return parsed


def test_a_check_that_found_nothing_is_not_repeated_until_something_changes() -> None:
    cache = Cache()
    steady(cache)
    assert needs_round(cache, KEY, Options(clock=lambda: NOW)) == (False, ANY_OPTIONS)
    assert cache.is_quiet(KEY, NOW + timedelta(seconds=299))
    assert not cache.is_quiet(KEY, NOW + timedelta(seconds=301))  # looked only that far ahead
    cache.put_pod(pod(0, phase="Failed"))
    assert not cache.is_quiet(KEY, NOW)


def test_a_step_that_time_makes_due_within_the_horizon_keeps_the_job_checked() -> None:
    cache = Cache()
    steady(cache, activeDeadlineSeconds=3600)
    assert not needs_round(cache, KEY, Options(clock=lambda: NOW))[0]
    start = cache.job(KEY).job.status.start_time  # type: ignore[union-attr]
    assert start is not None
    # Due in 100 s: quiet up to the farthest horizon with nothing due (60 s), not beyond.
    ahead = start + timedelta(seconds=3600 - 100)
    assert not needs_round(cache, KEY, Options(clock=lambda: ahead))[0]
    assert cache.is_quiet(KEY, ahead + timedelta(seconds=59))
    assert not cache.is_quiet(KEY, ahead + timedelta(seconds=61))
    soon = start + timedelta(seconds=3600 - 10)  # the deadline passes within every horizon
    assert not needs_round(cache, KEY, Options(clock=lambda: soon))[0]
    assert not cache.is_quiet(KEY, soon)
    assert needs_round(cache, KEY, Options(clock=lambda: soon + timedelta(seconds=11)))[0]


def test_a_job_deleted_and_created_again_is_not_quiet_from_its_predecessor() -> None:
    cache = Cache()
    steady(cache)
    signature = cache.signature(KEY)  # a check of the old job, still in flight
    cache.drop_job(KEY)
    cache.put_job({"apiVersion": "elastrain.dev/v1alpha1", "kind": "TrainingJob",
                   "metadata": {"name": "demo", "namespace": "ml", "uid": "u2",
                                "resourceVersion": "9", "generation": 1},
                   "spec": {"image": "img", "replicas": 2}})
    index = 10
    while cache.signature(KEY) < signature:  # the new job's own changes, as many as the old's
        cache.put_pod(pod(index, uid="u2", phase="Running"))
        index += 1
    cache.set_quiet(KEY, signature, NOW + timedelta(seconds=60))
    assert not cache.is_quiet(KEY, NOW)


def test_a_job_is_pollable_only_once_a_worker_is_ready_with_an_ip() -> None:
    cache = Cache()
    assert cache.pollable(KEY), "nothing known of its pods yet: poll as ever"
    cache.put_pod(pod(0))
    cache.put_pod(pod(1, phase="Running"))
    assert not cache.pollable(KEY), "pending or not Ready: nobody to ask"
    ready = pod(1, phase="Running")
    ready["status"].update(podIP="10.0.0.7", conditions=[{"type": "Ready", "status": "True"}])
    cache.put_pod(ready)
    assert cache.pollable(KEY)
    ready["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    cache.put_pod(ready)
    assert not cache.pollable(KEY)
