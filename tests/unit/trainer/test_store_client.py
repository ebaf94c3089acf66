"""inprocess.store_client: a store request that does not come back within its bound is given up
(docs/recovery.md section 7). A blocked callable stands for a request to a store that answers
nothing: what is under test is the bound and what is given up, not the store."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from elastrain_trainer.inprocess import store_client
from elastrain_trainer.inprocess.store_client import (
    BoundedCalls,
    StoreUnansweredError,
    TrainingClient,
    within_for,
)


def test_a_call_past_its_bound_raises_and_the_next_goes_to_a_new_worker() -> None:
    calls = BoundedCalls(0.2, "test")
    release = threading.Event()
    seen: dict[str, Any] = {}

    def blocked() -> int:
        release.wait(10)
        seen["current_after"] = calls.on_current_worker()
        return 1

    started = time.monotonic()
    with pytest.raises(StoreUnansweredError, match=r"within 0\.2 s"):
        calls.call(blocked)
    assert time.monotonic() - started < 2
    # The next call is not queued behind the blocked one.
    assert calls.call(lambda: calls.on_current_worker()) is True
    release.set()
    time.sleep(0.2)
    assert seen == {"current_after": False}  # the given-up worker knows it is


def test_an_error_is_raised_in_the_caller() -> None:
    def fails() -> None:
        raise KeyError("k")

    with pytest.raises(KeyError):
        BoundedCalls(1.0, "test").call(fails)


def test_a_client_given_up_refuses_every_use_until_replaced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(store_client, "emit", lambda e, **kw: events.append((e, kw)))
    first, second = object(), object()
    client = TrainingClient(first, "a", 0.1)  # type: ignore[arg-type]
    assert client.store is first and client.away_since is None
    release = threading.Event()
    for _ in range(2):
        with pytest.raises(StoreUnansweredError):
            client.bounded(lambda: release.wait(10))
    assert client.away_since is not None
    with pytest.raises(StoreUnansweredError, match="not reached again"):
        client.store  # noqa: B018
    assert events == [("store_unanswered", {"node": "a", "within_s": 0.1})]  # told once
    client.replace(second)  # type: ignore[arg-type]
    assert client.store is second and client.away_since is None
    release.set()


def test_the_boundary_waits_a_fifth_of_the_heartbeat_timeout_at_least_a_second() -> None:
    assert within_for(5.0) == 1.0
    assert within_for(2.0) == 1.0
    assert within_for(30.0) == 6.0
