"""Restart mode's checkpoint fence (session.restart_fence) against a real TCPStore: each
worker group takes the next generation when it forms; a group's commit passes while it is the
newest, is refused once a newer group formed or the store was replaced by one another group
claimed, and goes ahead while the store cannot answer (the bucket's rule still applies). A
new store's first group continues the bucket's line of generations (RestartFence.found), so a
coordinator cut off with the old store is refused by the bucket."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest
from elastrain_trainer.checkpoint import manifest as mf
from elastrain_trainer.checkpoint.catalog import line_of
from elastrain_trainer.checkpoint.local import LocalStorage
from elastrain_trainer.checkpoint.root import scan
from elastrain_trainer.inprocess.fence import FencedError
from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.session.restart_fence import STORE_RUN, RestartFence, claim_generation


def a_store() -> tuple[TCPStore, int]:
    server = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                      timeout=timedelta(seconds=10))
    return server, server.port


def client(port: int) -> Callable[[], MembershipStore]:
    return lambda: MembershipStore.connect("127.0.0.1", port, STORE_RUN,
                                           connect_within=timedelta(seconds=20))


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


def group(connect: Callable[[], MembershipStore], pod: str, storage: LocalStorage,
          newest: Callable[[], tuple[str, int] | None] | None = None
          ) -> tuple[RestartFence, CheckpointManager]:
    """A worker group forming as its coordinator does (start_dark_peer_watch, then
    session.process.record_group_generation once its root is read)."""
    epoch, gen = claim_generation(connect(), pod)
    fence = RestartFence(connect, epoch, gen)
    manager = CheckpointManager(storage, keep=5, async_save=False, run="r", fence=fence)
    fence.found(newest or (lambda: line_of(scan(storage), "r")))
    marked = manager.mark_generation(fence.lineage, fence.gen)
    assert marked is not None
    marked.join(timeout=30)
    return fence, manager


def test_a_group_on_a_replaced_store_continues_the_buckets_line_and_fences_the_old_coordinator(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The store pod's node goes dark with the coordinator of generation 2 on it, holding a
    save whose shards are written; the job gets a new, empty store, whose counter starts again
    at 1. Its first group continues the bucket's line (the old store's lineage, generation 3)
    and records it, so the old coordinator, which its old store still vouches for, is refused
    when it commits after the heal: no marker, `latest` unmoved."""
    storage = LocalStorage(tmp_path / "ckpt")
    old_server, old_port = a_store()
    on_old = client(old_port)
    first, manager = group(on_old, "pod-a", storage)
    assert (first.lineage, first.gen) == (first.epoch, 1)  # the bucket was empty: founded here
    manager.save(SaveRequest(10, {"w": torch.full((2,), 10.0)}))
    cut_off, stale = group(on_old, "pod-a", storage)
    assert (cut_off.lineage, cut_off.gen) == (first.epoch, 2)
    stale.save(SaveRequest(20, {"w": torch.full((2,), 20.0)}))
    assert stale.failed_saves == 0, stale.last_error

    new_server, new_port = a_store()
    on_new = client(new_port)
    fence, manager = group(on_new, "pod-b", storage)
    assert fence.epoch != first.epoch
    assert (fence.lineage, fence.gen) == (first.epoch, 3), "the new store began a line of its own"
    assert MembershipStore(new_server, STORE_RUN).generation() == 3

    assert cut_off() == (first.epoch, 2)  # the old store, still running, vouches for it
    stale.save(SaveRequest(30, {"w": torch.full((2,), -1.0)}))
    assert stale.failed_saves == 1, "the old coordinator's commit went in"
    assert "generation 3 of this lineage began" in str(stale.last_error), stale.last_error
    assert storage.read(mf.LATEST) == b"step-00000020"
    manager.save(SaveRequest(30, {"w": torch.full((2,), 30.0)}))
    assert manager.failed_saves == 0, manager.last_error
    catalog = scan(storage)
    assert [(c.step, c.store_epoch, c.gen) for c in catalog.commits] == [
        (10, first.epoch, 1), (20, first.epoch, 2), (30, first.epoch, 3)]
    assert storage.read(mf.LATEST) == b"step-00000030.2"

    # The new store's next group reads the lineage from the store, not the bucket.
    def no_bucket() -> tuple[str, int] | None:
        raise AssertionError("the store's lineage was founded already")

    again, _ = group(on_new, "pod-b", storage, newest=no_bucket)
    assert (again.lineage, again.gen) == (first.epoch, 4)
    del old_server, new_server


def test_a_group_that_cannot_read_its_bucket_keeps_its_stores_incarnation_and_founds_nothing(
        tmp_path: Path) -> None:
    server, port = a_store()
    connect = client(port)
    epoch, gen = claim_generation(connect(), "pod-a")
    fence = RestartFence(connect, epoch, gen)

    def unreadable() -> tuple[str, int] | None:
        raise OSError("the bucket is away")

    with pytest.raises(OSError):
        fence.found(unreadable)
    assert (fence.lineage, fence.gen) == (epoch, 1) and fence() == (epoch, 1)
    # The next group tries again, and founds the line then.
    epoch, gen = claim_generation(connect(), "pod-a")
    later = RestartFence(connect, epoch, gen)
    assert later.found(lambda: ("found:elsewhere", 7)) == ("found:elsewhere", 8)
    del server
