"""The checkpoint's fence against a real TCPStore: this node's generation while it is the
store's, FencedError once the world moved past it; while the store cannot answer the commit
goes ahead (training goes on without the store, and so do its checkpoints)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from elastrain_trainer.inprocess.fence import FencedError, StoreFence
from elastrain_trainer.inprocess.membership import Epoch, Plan
from elastrain_trainer.inprocess.store import MembershipStore


def plan(gen: int) -> Plan:
    return Plan(gen=gen, step=10, world_size=2, nodes=("a", "b"), heal={}, reason="start",
                global_batch=8, accum=1)


def test_the_fence_passes_in_the_current_generation_and_refuses_once_it_moved_on() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                      timeout=timedelta(seconds=10))
    port = server.port

    def connect(within: timedelta | None) -> MembershipStore:
        return MembershipStore.connect("127.0.0.1", port, "run", connect_within=within)

    world = MembershipStore(server, "run")
    assert world.try_advance(0) and world.try_advance(1)  # generation 2 is current
    epoch = Epoch(True, "a", "n1")
    mine: list[Plan | None] = [plan(2)]
    stop: list[int | None] = [None]
    fence = StoreFence(connect, lambda: (epoch, mine[0], stop[0]))
    assert fence() == (epoch.text(), 2)
    assert world.try_advance(2)  # the others planned generation 3 without this node
    with pytest.raises(FencedError, match="planned out: generation 3 is the world's, this "
                                          "node's is 2"):
        fence()
    stop[0] = 3  # generation 3 is a stop whose save this node makes on its old group
    assert fence() == (epoch.text(), 2)
    stop[0] = None
    mine[0] = plan(3)  # a node kept in generation 3 commits
    assert fence()[1] == 3
    mine[0] = None
    with pytest.raises(FencedError, match="in no generation"):
        fence()
    mine[0] = plan(3)
    del world, server  # the store is gone: the commit goes ahead, its generation recorded
    assert fence() == (epoch.text(), 3)


def test_a_fence_whose_heartbeat_lost_the_store_does_not_wait_on_it() -> None:
    def unreachable(within: timedelta | None) -> MembershipStore:
        raise AssertionError("the fence waited on a store its heartbeat knows is lost")

    fence = StoreFence(unreachable, lambda: (None, plan(4), None), lambda: True)
    assert fence() == ("", 4)


def test_a_commit_records_its_plans_lineage_not_the_store_it_was_made_in() -> None:
    """Generations of one lineage compare across stores replaced and restored; a plan from
    before lineages records the store's incarnation, as before."""
    founded = Epoch(False, "a", "n0")
    kept = Epoch(True, "b", "n2")
    mine = dataclasses.replace(plan(22), lineage=founded.text())
    assert StoreFence(lambda _: None, lambda: (kept, mine, None),  # type: ignore[arg-type,return-value]
                      lambda: True)() == (founded.text(), 22)
    assert StoreFence(lambda _: None, lambda: (kept, plan(22), None),  # type: ignore[arg-type,return-value]
                      lambda: True)() == (kept.text(), 22)
