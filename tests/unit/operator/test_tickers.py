"""Which per-job tickers may run (tickers.Tickers): one per live job, none for a job gone."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import cast

import pytest

from elastrain_operator import metrics
from elastrain_operator.k8s.cache import Cache
from elastrain_operator.k8s.client import Kube
from elastrain_operator.startup import OperatorState
from elastrain_operator.tickers import Tickers
from elastrain_operator.workqueue import WorkQueue

KEY = ("ml", "demo")


def on_loop(fn: Callable[[], Awaitable[None]]) -> None:
    """Tickers lives on kopf's event loop; its stop events need one."""
    asyncio.run(fn())  # type: ignore[arg-type]


def gauge() -> float | None:
    return metrics.REGISTRY.get_sample_value("elastrain_operator_tickers")


def test_a_deleted_job_stops_its_ticker_and_leaves_nothing() -> None:
    async def run() -> None:
        tickers = Tickers()
        tickers.job_seen(KEY, "u1")
        stop = tickers.start(KEY, "u1")
        assert stop is not None and not stop.is_set()
        assert tickers.count() == 1 and gauge() == 1
        tickers.job_gone(KEY, "u1")
        assert stop.is_set()
        tickers.finished(KEY, "u1")
        assert tickers.count() == 0 and gauge() == 0
        assert tickers == Tickers(), "a deleted job left something behind"

    on_loop(run)


def test_a_ticker_spawned_after_its_job_was_deleted_does_not_run() -> None:
    async def run() -> None:
        tickers = Tickers()
        tickers.job_seen(KEY, "u1")  # created and deleted within one batch of events:
        tickers.job_gone(KEY, "u1")  # kopf spawns the daemon after both were handled
        assert tickers.start(KEY, "u1") is None
        assert tickers.start(("ml", "never-seen"), "u9") is None
        assert tickers.count() == 0

    on_loop(run)


def test_a_job_created_again_under_the_same_name_has_exactly_one() -> None:
    async def run() -> None:
        tickers = Tickers()
        tickers.job_seen(KEY, "u1")
        old = tickers.start(KEY, "u1")
        assert tickers.start(KEY, "u1") is None, "a second ticker for the same job"
        # kopf handles each uid's events in order, different uids' concurrently: the new job
        # can be seen before the old one's DELETED.
        tickers.job_seen(KEY, "u2")
        new = tickers.start(KEY, "u2")
        tickers.job_gone(KEY, "u1")
        assert old is not None and new is not None and old.is_set() and not new.is_set()
        tickers.finished(KEY, "u1")
        assert tickers.count() == 1
        assert tickers.start(KEY, "u2") is None

    on_loop(run)


def test_the_cache_keeps_a_new_job_when_its_predecessor_s_deletion_comes_late() -> None:
    cache = Cache()
    cache.put_job({"metadata": {"name": KEY[1], "namespace": KEY[0], "uid": "u2",
                                "resourceVersion": "2"}, "spec": {"image": "img"}})
    cache.drop_job(KEY, "u1")
    assert cache.job(KEY) is not None
    cache.drop_job(KEY, "u2")
    assert cache.job(KEY) is None


def test_the_ticker_ticks_until_its_job_is_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    """handlers.job_ticker as kopf runs it: queues routine checks, returns on DELETED."""
    from elastrain_operator import handlers

    monkeypatch.setattr(handlers, "TIMER_INTERVAL_SECONDS", 0.01)
    state = OperatorState(queue=WorkQueue(lambda key, poll: None, workers=0, retry_seconds=0))
    assert state.queue is not None

    async def run() -> None:
        state.tickers.job_seen(KEY, "u1")
        ticker = asyncio.create_task(handlers.job_ticker(
            namespace=KEY[0], name=KEY[1], uid="u1", memo=SimpleNamespace(state=state),
            stopped=NeverStopped()))
        while not state.queue.depth():  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        assert state.tickers.count() == 1
        state.tickers.job_gone(KEY, "u1")
        await asyncio.wait_for(ticker, 5)
        assert state.tickers.count() == 0

    on_loop(run)


class NeverStopped:
    """kopf's DaemonStopped while kopf has not asked the daemon to stop."""

    def __bool__(self) -> bool:
        return False


def test_a_deleted_job_leaves_the_phase_gauge_after_its_last_round() -> None:
    def suspended() -> float:
        return metrics.REGISTRY.get_sample_value("elastrain_operator_jobs",
                                                 {"phase": "Suspended"}) or 0.0

    before = suspended()
    metrics.record_job("u-deleted", "Suspended")
    state = OperatorState(kube=cast(Kube, object()))  # a job gone needs no request
    state.job_deleted(KEY, "u-deleted")
    assert suspended() == before + 1, "forgotten before the key's round, which could record it"
    state.handle(KEY, False)
    assert suspended() == before


def test_a_job_whose_worker_moves_is_polled_every_tick() -> None:
    """While a worker moves (policy.notices), the old pod leaves once a poll sees its
    replacement in the world's plan: every tick polls, not every PROGRESS_INTERVAL."""
    from elastrain_operator import handlers

    class Recorder:
        def __init__(self) -> None:
            self.polls: list[bool] = []

        def add(self, key: tuple[str, str], *, urgent: bool, poll: bool = False) -> None:
            self.polls.append(poll)

    for moving, want in ((None, 1), ("demo-worker-0-0", 2)):
        recorder = Recorder()
        state = OperatorState(queue=cast(WorkQueue, recorder))
        state.cache.put_job({
            "apiVersion": "elastrain.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": KEY[1], "namespace": KEY[0], "uid": "u1",
                         "resourceVersion": "1", "generation": 1},
            "spec": {"image": "img", "replicas": 2, "recovery": {"mode": "InProcess"}},
            "status": {"slots": [{"index": 0, "attempt": 1, "movingFrom": moving}]}})
        handlers.tick(state, KEY, "u1")
        handlers.tick(state, KEY, "u1")  # at once: PROGRESS_INTERVAL has not passed
        assert recorder.polls.count(True) == want, (moving, recorder.polls)
