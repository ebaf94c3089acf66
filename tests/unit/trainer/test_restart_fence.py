"""Restart mode's checkpoint fence (session.restart_fence) against a real TCPStore: each
worker group takes the next generation when it forms; a group's commit passes while it is the
newest, is refused once a newer group formed or the store was replaced by one another group
claimed, and goes ahead while the store cannot answer (the bucket's rule still applies)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from elastrain_trainer.inprocess.fence import FencedError
from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.session.restart_fence import STORE_RUN, RestartFence, claim_generation


def a_store() -> tuple[TCPStore, int]:
    server = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                      timeout=timedelta(seconds=10))
    return server, server.port


def client(port: int) -> Callable[[], MembershipStore]:
    return lambda: MembershipStore.connect("127.0.0.1", port, STORE_RUN,
                                           connect_within=timedelta(seconds=2))


def test_a_group_commits_while_newest_and_is_refused_once_a_group_formed_without_it() -> None:
    server, port = a_store()
    connect = client(port)

    epoch, first = claim_generation(connect(), "pod-a")
    assert first == 1
    fence = RestartFence(connect, epoch, first)
    assert fence() == (epoch, 1)
    again, second = claim_generation(connect(), "pod-b")  # the agents re-formed the group
    assert (again, second) == (epoch, 2)  # the same store: its first claim stands
    with pytest.raises(FencedError, match="generation 2 is the worker group's, this "
                                          "worker's is 1"):
        fence()
    assert RestartFence(connect, epoch, 2)() == (epoch, 2)
    del server  # the store is gone: the commit goes ahead with its generation recorded
    assert fence() == (epoch, 1)


def test_a_store_replaced_and_claimed_by_another_group_refuses_the_old_groups_commit() -> None:
    server, port = a_store()
    connect = client(port)

    old_epoch, _ = claim_generation(connect(), "pod-a")
    fence = RestartFence(connect, old_epoch, 5)  # a group that formed long ago
    assert fence() == (old_epoch, 5)
    store = MembershipStore(server, STORE_RUN)
    store.kv.delete_key("epoch")  # the store pod came back empty ...
    store.kv.delete_key("gen")
    assert fence() == (old_epoch, 5)  # ... and no group formed on it yet: still the newest
    new_epoch, new_gen = claim_generation(connect(), "pod-b")
    assert new_epoch != old_epoch and new_gen == 1
    with pytest.raises(FencedError, match="store was replaced"):
        fence()
