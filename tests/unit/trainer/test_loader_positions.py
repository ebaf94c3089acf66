"""elastrain_trainer.loaders without processes: the position arithmetic (positions.py) against
torch's own DistributedSampler, and the sampler and DataLoader adoption driven the way the
Session drives it (tracker.set_world at a generation, state_dict/load_state_dict at a save, a
resume, a heal or a step redone, check_step at each boundary).

The tracker is a process-wide singleton: `fresh_tracker` gives each test its own (the modules
read `tracking.tracker` when they adopt or open a pass), and `installed` undoes install()'s
patch of DataLoader's constructor, so nothing leaks into other tests. Several ranks of one world
are simulated in this process with one tracker each (`Rank`)."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from elastrain_trainer.loaders import ElasticSampler, StaleBatchError, install, positions, tracking
from elastrain_trainer.loaders.loader import is_adopted
from elastrain_trainer.loaders.sampler import Position


@pytest.fixture
def fresh_tracker(monkeypatch: pytest.MonkeyPatch) -> tracking.DataTracker:
    fresh = tracking.DataTracker()
    monkeypatch.setattr(tracking, "tracker", fresh)
    return fresh


@pytest.fixture
def installed(fresh_tracker: tracking.DataTracker) -> Iterator[tracking.DataTracker]:
    """install() for one test: DataLoader's (and its subclasses') constructors and
    __init_subclass__ put back afterwards."""
    classes = [DataLoader, *tracking._subclasses(DataLoader)]
    inits = {cls: cls.__dict__.get("__init__") for cls in classes}
    subclass_hook = DataLoader.__dict__.get("__init_subclass__")
    install()
    yield fresh_tracker
    for cls in [DataLoader, *tracking._subclasses(DataLoader)]:
        if cls in inits and inits[cls] is not None:
            cls.__init__ = inits[cls]  # type: ignore[misc]
    if subclass_hook is None:
        if "__init_subclass__" in DataLoader.__dict__:
            delattr(DataLoader, "__init_subclass__")
    else:
        DataLoader.__init_subclass__ = subclass_hook  # type: ignore[method-assign]


def dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def torch_order(n: int, world: int, rank: int, *, seed: int = 3, epoch: int = 0,
                shuffle: bool = True, drop_last: bool = False) -> list[int]:
    """What torch's own DistributedSampler gives rank `rank` of `world`."""
    s: DistributedSampler[Any] = DistributedSampler(
        dataset(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
        drop_last=drop_last)
    s.set_epoch(epoch)
    return list(s)


# -- positions.py: pure -----------------------------------------------------------------------

@pytest.mark.parametrize("shuffle", [True, False])
def test_epoch_order_is_distributed_samplers_order_before_its_padding(shuffle: bool) -> None:
    for epoch in (0, 1, 5):
        order = positions.epoch_order(13, shuffle=shuffle, seed=3, epoch=epoch)
        assert order == torch_order(13, 1, 0, epoch=epoch, shuffle=shuffle)
    assert positions.epoch_order(13, shuffle=True, seed=3, epoch=0) != positions.epoch_order(
        13, shuffle=True, seed=3, epoch=1)


@pytest.mark.parametrize("n", [12, 13, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_indices_from_offset_0_are_distributed_samplers_at_a_fixed_world(
        n: int, world: int, drop_last: bool) -> None:
    """Padding (n=13, 2 < world) and drop_last included: position p >= n reads order[p % n]."""
    for epoch in (0, 2):
        order = positions.epoch_order(n, shuffle=True, seed=3, epoch=epoch)
        for rank in range(world):
            got = positions.rank_indices(order, 0, world, rank, drop_last=drop_last)
            assert got == torch_order(n, world, rank, epoch=epoch, drop_last=drop_last), (
                epoch, rank)


def test_pass_length_pads_to_a_multiple_of_the_world_or_drops_the_tail() -> None:
    assert positions.pass_length(13, 0, 4, drop_last=False) == 16
    assert positions.pass_length(13, 8, 4, drop_last=False) == 8  # 5 left, 3 padded
    assert positions.pass_length(13, 8, 4, drop_last=True) == 4
    assert positions.pass_length(13, 13, 4, drop_last=False) == 0
    assert positions.pass_length(13, 20, 4, drop_last=False) == 0  # past the end: nothing
    order = list(range(100, 113))
    # From offset 11 at world 4: positions 11..14, 13 and 14 are the epoch's first two.
    assert [positions.rank_indices(order, 11, 4, r, drop_last=False) for r in range(4)] == [
        [111], [112], [100], [101]]


def test_rank_positions_refuse_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        positions.rank_positions(10, 0, 2, 2, drop_last=False)


def test_offset_after_counts_every_ranks_batches_and_stops_at_the_pass_end() -> None:
    assert positions.offset_after(8, 3, 4, 2, 40) == 8 + 3 * 4 * 2
    assert positions.offset_after(8, 6, 4, 2, 40) == 48  # the last batch short: the pass end


# -- the sampler, adopted or built --------------------------------------------------------------

@pytest.mark.parametrize("drop_last", [False, True])
def test_elastic_sampler_draws_distributed_samplers_order_at_a_fixed_world(
        fresh_tracker: tracking.DataTracker, drop_last: bool) -> None:
    samplers = [ElasticSampler(dataset(13), seed=3, drop_last=drop_last) for _ in range(3)]
    for rank, sampler in enumerate(samplers):
        sampler.set_world(rank, 3)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            want = torch_order(13, 3, rank, epoch=epoch, drop_last=drop_last)
            assert list(sampler) == want
            assert len(sampler) == len(want)  # DistributedSampler's sizes recomputed
    assert fresh_tracker.samplers == samplers  # known to the tracker, in creation order


def test_a_distributed_sampler_is_adopted_in_place_and_follows_the_trackers_world(
        fresh_tracker: tracking.DataTracker) -> None:
    sampler: DistributedSampler[Any] = DistributedSampler(dataset(10), num_replicas=1, rank=0,
                                                          seed=3)
    loader = DataLoader(dataset(10), batch_size=2, sampler=sampler)
    fresh_tracker.adopt(loader)
    assert type(sampler) is ElasticSampler and isinstance(sampler, DistributedSampler)
    assert is_adopted(loader) and isinstance(loader, DataLoader)
    assert loader.sampler is sampler and fresh_tracker.micro_batch == 2
    fresh_tracker.set_world(1, 2)
    assert (sampler.rank, sampler.num_replicas, len(sampler), len(loader)) == (1, 2, 5, 3)
    assert list(sampler) == torch_order(10, 2, 1)
    fresh_tracker.adopt(loader)  # again: still one loader, one sampler
    assert len(fresh_tracker.loaders) == 1 and len(fresh_tracker.samplers) == 1


def test_install_adopts_loaders_as_they_are_built_subclasses_too(
        installed: tracking.DataTracker) -> None:
    build = getattr(DataLoader.__init__, "__wrapped__", DataLoader.__init__)

    class Stateful(DataLoader):  # type: ignore[type-arg]
        """Defined after install(); builds itself without DataLoader.__init__ (a copy of it,
        as torchdata's StatefulDataLoader has): only watching the subclass adopts it."""

        def __init__(self, data: Any, **kwargs: Any) -> None:
            build(self, data, **kwargs)

    plain = DataLoader(dataset(8), batch_size=2, sampler=DistributedSampler(
        dataset(8), num_replicas=1, rank=0))
    sub = Stateful(dataset(8), batch_size=4, sampler=DistributedSampler(
        dataset(8), num_replicas=1, rank=0))
    unsampled = DataLoader(dataset(8), batch_size=2)
    assert is_adopted(plain) and is_adopted(sub) and isinstance(sub, Stateful)
    assert not is_adopted(unsampled)
    assert len(installed.samplers) == 2

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[int]:
            return iter(range(4))

    DataLoader(Stream(), batch_size=2)
    assert installed.iterable == ["Stream"]  # noted: the Session refuses it in process


def test_a_stale_set_epoch_after_a_restore_raises_and_a_newer_one_starts_at_offset_0(
        fresh_tracker: tracking.DataTracker) -> None:
    sampler = ElasticSampler(dataset(16), seed=3)
    sampler.restore(Position(epoch=3, offset=8, in_pass=True))
    sampler.set_epoch(3)  # the resumed loop's own epoch: its position is kept
    assert (sampler.position.epoch, sampler.position.offset) == (3, 8)
    with pytest.raises(ValueError, match=r"set_epoch\(2\) after the Session restored this "
                                         r"sampler in epoch 3.*sampler\.epoch"):
        sampler.set_epoch(2)
    sampler.set_epoch(4)
    assert sampler.position == Position(epoch=4, offset=0) and sampler.epoch == 4
    sampler.set_epoch(1)  # no restore since: a script's own choice, not refused
    assert sampler.position.epoch == 1


# -- several ranks of one world, in this process ------------------------------------------------

class Rank:
    """One rank's sampler, loader and pass, under a tracker of its own (as in its process)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n: int, micro: int, rank: int,
                 world: int, *, global_batch: int,
                 state: dict[str, Any] | None = None) -> None:
        self.tracker = tracking.DataTracker()
        self.tracker.global_batch = global_batch
        with monkeypatch.context() as m:
            m.setattr(tracking, "tracker", self.tracker)
            if state is not None:  # a resume: positions loaded before the loader exists
                self.tracker.load_state_dict(state)
            self.tracker.set_world(rank, world)
            built: DistributedSampler[Any] = DistributedSampler(
                dataset(n), num_replicas=world, rank=rank, shuffle=True, seed=3)
            self.loader = DataLoader(dataset(n), batch_size=micro, sampler=built)
            self.tracker.adopt(self.loader)
            assert isinstance(built, ElasticSampler)  # adopted in place
            self.sampler = built
            self.it = iter(self.loader)
        self.read: list[tuple[int, int]] = []  # (epoch, index)

    def draw(self, batches: int) -> int:
        """Up to `batches` micro-batches of this pass; how many there were."""
        drawn = 0
        for _ in range(batches):
            try:
                (x,) = next(self.it)
            except StopIteration:
                break
            self.read += [(self.sampler.epoch, int(i)) for i in x]
            drawn += 1
        return drawn


def world_of(monkeypatch: pytest.MonkeyPatch, n: int, micro: int, world: int,
             global_batch: int) -> list[Rank]:
    return [Rank(monkeypatch, n, micro, r, world, global_batch=global_batch)
            for r in range(world)]


def step(ranks: list[Rank], global_batch: int, micro: int, index: int) -> None:
    """One step: every rank draws session.accum micro-batches, then the boundary's check."""
    accum, rest = divmod(global_batch, micro * len(ranks))
    assert rest == 0, "a world the plan never picks"
    for r in ranks:
        r.draw(accum)
        r.tracker.check_step(index)


def test_a_world_change_mid_epoch_reads_every_index_once_and_pads_only_at_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """30 samples, micro 2, global batch 8: two steps at world 2 (2 micro-batches per rank),
    then the survivors' trackers set to world 4 (their open passes reopen at the new world)
    and ranks 2 and 3 join with the positions sent to them; the epoch's last 14 positions are
    read in two steps at world 4, padded to 16 with the epoch's first two indices."""
    ranks = world_of(monkeypatch, 30, 2, 2, 8)
    for i in range(2):
        step(ranks, 8, 2, i)
    sent = ranks[0].tracker.state_dict()
    assert json.loads(sent["positions"]) == [{"epoch": 0, "offset": 16, "in_pass": True}]
    for r, rank in enumerate(ranks):
        rank.tracker.set_world(r, 4)
    ranks += [Rank(monkeypatch, 30, 2, r, 4, global_batch=8, state=sent) for r in (2, 3)]
    for i in (2, 3):
        step(ranks, 8, 2, i)
    read = collections.Counter(i for rank in ranks for _, i in rank.read)
    order = positions.epoch_order(30, shuffle=True, seed=3, epoch=0)
    assert read == collections.Counter(range(30)) + collections.Counter(order[:2])
    assert all(rank.draw(1) == 0 for rank in ranks)  # the epoch's end, on every rank


def test_a_step_that_reads_another_count_than_the_global_batch_raises_stale_batch_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    (rank,) = world_of(monkeypatch, 40, 4, 1, 8)
    rank.tracker.check_step(0)
    rank.draw(2)  # 2 x 4 x world 1: the global batch
    rank.tracker.check_step(1)
    rank.tracker.check_step(2)  # nothing read (another loader's step): not this one's error
    rank.draw(1)  # an accumulation computed at world 2, read at world 1
    with pytest.raises(StaleBatchError, match=r"step 3 read 4 samples .* global batch is 8: "
                                              r"at world size 1 each rank draws "
                                              r"session.accum = 2 micro-batches of 4"):
        rank.tracker.check_step(3)


def test_the_epochs_short_last_step_is_not_a_stale_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """22 samples: two steps of 8, then one that reads the last 4 and 2 and ends at the pass's
    end (no StopIteration yet): 6 samples, the epoch's rest, not a stale accumulation."""
    (rank,) = world_of(monkeypatch, 22, 4, 1, 8)
    rank.tracker.check_step(0)
    for i in (1, 2, 3):
        assert rank.draw(2) == 2
        rank.tracker.check_step(i)
    assert len(rank.read) == 22 and rank.sampler.position.in_pass


def test_load_state_dict_restores_the_position_and_the_open_pass_reads_from_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step redone after a lost peer: the body's state is put back, and the script's own
    iterator reads the same batch again, not the next one."""
    (rank,) = world_of(monkeypatch, 40, 4, 1, 8)
    rank.draw(2)
    before = rank.tracker.state_dict()
    rank.draw(2)
    undone = rank.read[8:]
    rank.tracker.load_state_dict(before)
    assert rank.sampler.position == Position(epoch=0, offset=8, in_pass=True)
    rank.draw(2)
    assert rank.read[16:] == undone


def test_a_resume_continues_the_saved_pass_and_only_that_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A new process whose checkpoint says epoch 1, offset 12: the script's first iter(loader)
    continues there (built before or after the load), its loop's set_epoch(1) keeps it, and
    the next pass of the next epoch starts at 0."""
    (first,) = world_of(monkeypatch, 20, 4, 1, 8)
    first.sampler.set_epoch(1)
    first.it = iter(first.loader)
    first.draw(3)
    saved = first.tracker.state_dict()
    first.draw(5)
    rest = [i for _, i in first.read[12:]]  # what the interrupted run would have read next
    resumed = Rank(monkeypatch, 20, 4, 0, 1, global_batch=8, state=saved)
    resumed.sampler.set_epoch(1)
    assert resumed.draw(5) == 2
    assert [i for _, i in resumed.read] == rest
    resumed.sampler.set_epoch(2)
    resumed.it = iter(resumed.loader)
    assert resumed.draw(5) == 5
    assert [i for _, i in resumed.read[8:]] == torch_order(20, 1, 0, epoch=2)


def test_a_new_pass_without_a_restore_starts_the_epoch_at_offset_0(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that leaves a pass early and opens another in the same epoch (no set_epoch)
    reads the epoch from its start again, as with torch's sampler; only the first pass after
    a restore continues."""
    (rank,) = world_of(monkeypatch, 12, 4, 1, 4)
    rank.draw(2)
    rank.it = iter(rank.loader)
    rank.draw(5)
    assert [i for _, i in rank.read[8:]] == torch_order(12, 1, 0)


class Endless(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[int]:
        return iter(range(10**9))


def test_in_process_a_loader_over_an_iterable_dataset_is_refused_naming_it(
        installed: tracking.DataTracker, monkeypatch: pytest.MonkeyPatch) -> None:
    """It cannot be re-split at a world change: the Session refuses it before joining (and
    leaves it alone in Restart mode, where each world starts in new processes)."""
    from elastrain_trainer.session import world
    from elastrain_trainer.session.process import process

    DataLoader(Endless(), batch_size=4)
    assert installed.iterable == ["Endless"]
    monkeypatch.setattr(world, "tracker", installed)
    session = world.WorldChanges()
    session._global_batch = None
    monkeypatch.setattr(process, "inprocess", None)
    session._plan_batch()  # Restart mode: nothing to refuse
    monkeypatch.setattr(process, "inprocess", object())
    with pytest.raises(ValueError, match=r"a DataLoader over an IterableDataset \(Endless\) "
                                         "cannot be re-split when the world changes in process"):
        session._plan_batch()


@pytest.mark.parametrize(("env", "global_batch", "planned", "refusal"), [
    ({}, None, 8, None),  # unset: the loader's 4 x 2 replicas
    ({"ELASTRAIN_GLOBAL_BATCH_SIZE": "16"}, None, 16, None),  # the spec's, in 2 accumulations
    ({"ELASTRAIN_MICRO_BATCH_SIZE": "4", "ELASTRAIN_GLOBAL_BATCH_SIZE": "16"}, 16, 16, None),
    ({"ELASTRAIN_MICRO_BATCH_SIZE": "2"}, None, None,
     r"the DataLoader's batch_size 4 is not spec.trainer.microBatchSize 2 "
     r"\(ELASTRAIN_MICRO_BATCH_SIZE\): make them equal"),
    ({"ELASTRAIN_GLOBAL_BATCH_SIZE": "16"}, 24, None,
     r"Session\(global_batch=24\) is not spec.trainer.globalBatchSize 16"),
])
def test_the_spec_batch_where_set_must_be_the_scripts(
        installed: tracking.DataTracker, monkeypatch: pytest.MonkeyPatch,
        env: dict[str, str], global_batch: int | None, planned: int | None,
        refusal: str | None) -> None:
    """spec.trainer's batch reaches the trainer only where the job sets it; then a script's
    loader (and Session(global_batch=)) must agree with it before the first step, in both
    modes, rather than train another batch than the job says."""
    from types import SimpleNamespace

    from elastrain_trainer.session import world
    from elastrain_trainer.session.process import process

    for name in ("ELASTRAIN_GLOBAL_BATCH_SIZE", "ELASTRAIN_MICRO_BATCH_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    data = TensorDataset(torch.arange(64))
    loader = DataLoader(data, batch_size=4,
                        sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert installed.micro_batch == loader.batch_size  # adopted (the tracker holds a weakref)
    monkeypatch.setattr(world, "tracker", installed)
    monkeypatch.setattr(process, "inprocess", None)  # Restart mode: torchrun's world of 2
    session = world.WorldChanges()
    session._global_batch = global_batch
    session.denv = SimpleNamespace(world_size=2)  # type: ignore[assignment]
    if refusal is None:
        session._plan_batch()
        assert installed.global_batch == planned
    else:
        with pytest.raises(ValueError, match=refusal):
            session._plan_batch()


# -- a stream that reads by global position (loaders/stream.py) ---------------------------------

class Indexed(IterableDataset):  # type: ignore[type-arg]
    """A seekable stream: sample p is the tensor [p]."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def read(self, positions: range) -> Iterator[torch.Tensor]:
        for p in positions:
            yield torch.tensor(p)

    def __iter__(self) -> Iterator[torch.Tensor]:  # not adopted: the whole stream, one reader
        return self.read(range(self.n))


class StreamRank:
    """One rank's stream loader under a tracker of its own (as in its process)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n: int, micro: int, rank: int,
                 world: int, *, workers: int = 0, state: dict[str, Any] | None = None) -> None:
        self.tracker = tracking.DataTracker()
        with monkeypatch.context() as m:
            m.setattr(tracking, "tracker", self.tracker)
            if state is not None:
                self.tracker.load_state_dict(state)
            self.tracker.set_world(rank, world)
            self.loader = DataLoader(Indexed(n), batch_size=micro, num_workers=workers)
            self.tracker.adopt(self.loader)
            self.it = iter(self.loader)
        self.read: list[int] = []

    def draw(self, batches: int) -> int:
        drawn = 0
        for _ in range(batches):
            try:
                x = next(self.it)
            except StopIteration:
                break
            self.read += x.tolist()
            drawn += 1
        return drawn


def torch_split(n: int, world: int, rank: int) -> list[int]:
    """What DistributedSampler(shuffle=False) gives rank `rank` of a map-style dataset."""
    return list(DistributedSampler(range(n), num_replicas=world, rank=rank,  # type: ignore[arg-type]
                                   shuffle=False))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_seekable_stream_is_split_as_a_distributed_sampler_splits(
        monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """Each rank reads DistributedSampler(shuffle=False)'s positions, in its order, padding
    included, with DataLoader workers too (each reads every k-th of the rank's batches);
    len(loader) is the rank's."""
    ranks = [StreamRank(monkeypatch, 30, 4, r, 4, workers=workers) for r in range(4)]
    for rank in ranks:
        assert len(rank.loader) == 2  # 8 positions per rank: 2 batches of 4
        assert rank.draw(10) == 2
    assert [r.read for r in ranks] == [torch_split(30, 4, r) for r in range(4)]


def test_a_seekable_stream_continues_across_a_world_change_and_a_resume(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """30 positions, micro 2, global batch 8: a step at world 2, a leave (rank 0 alone reads
    on from offset 8, DataLoader workers dropping what they prefetched), a step, then a resume at
    world 3 from the saved position: every position of the epoch read once, the epoch's tail
    padded at world 3."""
    a, b = (StreamRank(monkeypatch, 30, 2, r, 2, workers=2) for r in range(2))
    for r in (a, b):
        r.tracker.global_batch = 8
        r.draw(2)
        r.tracker.check_step(0)
    a.tracker.set_world(0, 1)  # b left: a's open pass reopens at world 1
    a.draw(4)
    a.tracker.check_step(1)
    saved = a.tracker.state_dict()
    assert json.loads(saved["positions"]) == [{"epoch": 0, "offset": 16, "in_pass": True}]
    resumed = [StreamRank(monkeypatch, 30, 2, r, 3, state=saved) for r in range(3)]
    for r in resumed:
        r.draw(10)
    assert sorted(a.read + b.read) == list(range(16))  # 2 steps, each position once
    assert [r.read for r in resumed] == [  # the 14 left at world 3, padded to 15 as torch pads
        [16, 19, 22, 25, 28], [17, 20, 23, 26, 29], [18, 21, 24, 27, 0]]
