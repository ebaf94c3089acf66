"""MembershipStore.heartbeats against a real TCPStore: the counters of every watched node in two
requests, however many nodes (issue 34: the heartbeat thread read one counter per request, so
a world of pods with 8 ranks each paid 8 round trips per pod per beat), and a node that never
beat reads 0 without a wait."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from elastrain_trainer.inprocess.store import MembershipStore


class Counted:
    """The real prefix store, each request counted on its way through."""

    def __init__(self, kv: Any) -> None:
        self.kv, self.calls = kv, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.kv, name)

        def call(*args: Any) -> Any:
            self.calls += 1
            return method(*args)
        return call


def test_the_counters_of_many_nodes_are_read_in_two_requests() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                      wait_for_workers=False, timeout=timedelta(seconds=5))
    store = MembershipStore(server, "run")
    nodes = [f"w-{p}/{r}" for p in range(4) for r in range(8)]
    for i, node in enumerate(nodes):
        for _ in range(i % 3 + 1):
            store.beat(node)
    counted = Counted(store.kv)
    store.kv = counted  # type: ignore[assignment]
    assert store.heartbeats(nodes) == {n: i % 3 + 1 for i, n in enumerate(nodes)}
    assert counted.calls == 2


def test_a_node_that_never_beat_reads_zero_and_the_rest_their_counters() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                      wait_for_workers=False, timeout=timedelta(seconds=5))
    store = MembershipStore(server, "run")
    store.beat("a")
    store.beat("a")
    assert store.heartbeats(["a", "new", "a"]) == {"a": 2, "new": 0}
    # Read once, the new counter exists: the next read is the two-request one.
    counted = Counted(store.kv)
    store.kv = counted  # type: ignore[assignment]
    assert store.heartbeats(["a", "new"]) == {"a": 2, "new": 0}
    assert counted.calls == 2
