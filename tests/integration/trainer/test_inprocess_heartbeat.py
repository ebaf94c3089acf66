"""The heartbeat thread against the job's store (a process of its own, the store pod's program)
reached through a TCP proxy, the way a pod reaches it through its Service: what it does while
the store is gone and how soon it is back once the store answers (docs/recovery.md sections 7
and 8). A fresh pod that finds the store empty waits one heartbeat timeout for the training
world to claim it, so the world's heartbeats must be back within that timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from elastrain_trainer.inprocess.heartbeat import Heartbeat
from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.ports import free_port
from tests.warmstart import started_pid

from .tcp_proxy import TcpProxy
from .test_inprocess import wait_for
from .test_inprocess_launcher import serve

pytestmark = [pytest.mark.timeout(120)]
TIMEOUT_S = 2.0  # the smallest heartbeat timeout: beats every 0.4 s
RUN = "heartbeat"


@pytest.fixture
def store_behind_proxy() -> Iterator[dict[str, Any]]:
    port = free_port()
    setup: dict[str, Any] = {"port": port, "store": serve(port)}
    setup["proxy"] = TcpProxy("127.0.0.1", port).start()
    yield setup
    setup["proxy"].cut()
    setup["store"].kill()
    setup["store"].wait()


def heartbeat(node: str, port: int) -> Heartbeat:
    def connect(within: timedelta | None) -> MembershipStore:
        return MembershipStore.connect("127.0.0.1", port, RUN, connect_within=within)
    return Heartbeat(connect, node, timeout_s=TIMEOUT_S,
                     probe=lambda: MembershipStore.reachable("127.0.0.1", port)).start()


def reconnected_after(hb: Heartbeat, count: int) -> Callable[[], bool]:
    return lambda: hb.reconnects > count


def test_a_heartbeat_is_back_within_its_timeout_once_the_store_answers_again(
        store_behind_proxy: dict[str, Any]) -> None:
    """Three times, the store is out of reach for 8 s while its address still accepts
    connections (a second proxy in front of the first stays up and closes each connection it
    cannot pass on, as a Service in front of a gone pod may): the heartbeat's probe passes, its
    client's connect fails. Each time, once the store answers again, the heartbeat is back
    within its timeout. Seen failing with the client's default connect (TCPStore retries for
    60 s with a backoff that grows to seconds): back 1.9 to 5.1 s after the store, and in CI a
    fresh pod that had waited its timeout founded the store before the training world could
    keep it (the world then ended its pods)."""
    s = store_behind_proxy
    front = TcpProxy("127.0.0.1", s["proxy"].port).start()
    hb = heartbeat("a", front.port)
    took: list[float] = []
    try:
        for _ in range(3):
            s["proxy"].cut()
            reconnects = hb.reconnects
            wait_for(lambda: hb.lost, "the heartbeat notices the loss", timeout=10)
            time.sleep(8.0)
            s["proxy"].heal()
            back = time.monotonic()
            wait_for(reconnected_after(hb, reconnects), "the heartbeat reconnects", timeout=90)
            took.append(round(time.monotonic() - back, 2))
    finally:
        hb.stop()
        front.cut()
    print(f"heartbeat back after the store answered again: {took} s")
    assert max(took) <= TIMEOUT_S, took


def test_a_node_that_lost_the_store_judges_no_peer_silent(
        store_behind_proxy: dict[str, Any]) -> None:
    """a reaches the store through the proxy, b directly; the proxy is cut for three heartbeat
    timeouts while b beats on. a cannot see b's beats, so it must judge nobody: no peer dead or
    silent while it has lost the store, nor once it is back. Seen failing before: a's
    heartbeat found b silent (its counter had not moved on a's clock), so a node whose
    heartbeat had not yet reconnected failed the next generation's entry ("['b'] silent before
    entering") and every node waited the group's init timeout for a new one."""
    s = store_behind_proxy
    a = heartbeat("a", s["proxy"].port)
    b = heartbeat("b", s["port"])
    try:
        a.watch(1, ["a", "b"])
        time.sleep(2 * a.interval_s)  # a observes b's counter moving
        assert not a.lost and not (a.dead() | a.silent())
        s["proxy"].cut()
        wait_for(lambda: a.lost, "a notices the loss", timeout=10)
        judged: set[str] = set()
        until = time.monotonic() + 3 * TIMEOUT_S
        while time.monotonic() < until:
            judged |= a.dead() | a.silent()
            time.sleep(0.05)
        assert a.lost and not b.lost
        s["proxy"].heal()
        wait_for(lambda: a.reconnects == 1, "a reconnects", timeout=30)
        until = time.monotonic() + TIMEOUT_S
        while time.monotonic() < until:
            judged |= a.dead() | a.silent()
            time.sleep(0.05)
    finally:
        a.stop()
        b.stop()
    assert not judged, judged


def test_the_progress_tells_how_long_a_frozen_store_has_answered_nothing(
        store_behind_proxy: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's process frozen (SIGSTOP: it accepts nothing, answers nothing, closes
    nothing): this node's /progress says how long its heartbeat has not heard the store, which
    the operator reads to replace a store none of the trainers hears (operator policy.store);
    once the store answers again it says so within an interval or two. The freeze outlasts
    the heartbeat's bound on a request (twice the timeout): its reconnects meanwhile are no
    answer either."""
    from elastrain_trainer import metrics

    s = store_behind_proxy
    monkeypatch.setattr(metrics, "_progress", metrics._Progress())
    assert "storeUnansweredSeconds" not in metrics.progress_document()
    hb = heartbeat("a", s["proxy"].port)
    metrics.watch_store(hb.unanswered_s)
    try:
        time.sleep(3 * hb.interval_s)
        assert metrics.progress_document()["storeUnansweredSeconds"] < 2 * hb.interval_s + 0.2
        # The store's own process: under a warm start (tests/warmstart) the Popen is a shim's.
        store_pid = started_pid(s["store"].pid)
        os.kill(store_pid, signal.SIGSTOP)
        frozen = time.monotonic()
        time.sleep(3 * TIMEOUT_S)
        told = metrics.progress_document()["storeUnansweredSeconds"]
        assert 3 * TIMEOUT_S - 2 * hb.interval_s - 0.2 <= told <= time.monotonic() - frozen + 0.1
        assert hb.lost and hb.reconnects == 0
        os.kill(store_pid, signal.SIGCONT)
        wait_for(lambda: metrics.progress_document()["storeUnansweredSeconds"] < 1.0,
                 "heard again", timeout=30)
    finally:
        with contextlib.suppress(OSError):
            os.kill(started_pid(s["store"].pid), signal.SIGCONT)
        hb.stop()
