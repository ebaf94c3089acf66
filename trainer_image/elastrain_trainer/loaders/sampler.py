"""ElasticSampler: a DistributedSampler whose world is the Session's current one.

It draws exactly DistributedSampler's order (loaders.positions), so a script that had a
DistributedSampler trains on the same samples; what it adds is a position (epoch, offset) that
the Session saves, sends to joiners and restores, and a world (rank, num_replicas) that the
Session sets at every generation. A DistributedSampler that a script built is adopted in place
(its class becomes this one), so `loader.sampler`, `sampler.set_epoch`, `len(loader)` and
`isinstance(..., DistributedSampler)` keep working.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data.distributed import DistributedSampler

from elastrain_trainer.loaders import positions


@dataclasses.dataclass
class Position:
    """Where the sampler's data stands: `offset` positions of `epoch` consumed by every rank
    together; `in_pass` while an iteration over its loader is under way (a resume continues it)."""

    epoch: int = 0
    offset: int = 0
    in_pass: bool = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Position:
        return cls(epoch=int(raw["epoch"]), offset=int(raw["offset"]),
                   in_pass=bool(raw["in_pass"]))


class ElasticSampler(DistributedSampler):  # type: ignore[type-arg]
    """`ElasticSampler(dataset, shuffle=True, seed=0, drop_last=False)`: DistributedSampler's
    samples, split over the Session's current world, continued from the Session's position."""

    position: Position
    # Set after a resume or heal: the epoch a stale `set_epoch` must not go back from.
    resumed_epoch: int | None
    # Where the current pass over its loader ends (its last step may be short).
    pass_end: int = 0
    passes: int = 0  # passes begun (an epoch loop without set_epoch makes several per epoch)

    def __init__(self, dataset: Sized, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed,  # type: ignore[arg-type]
                         drop_last=drop_last)
        adopt(self)

    def __iter__(self) -> Iterator[int]:
        order = positions.epoch_order(len(self.dataset), shuffle=self.shuffle,  # type: ignore[arg-type]
                                      seed=self.seed, epoch=self.position.epoch)
        return iter(positions.rank_indices(order, self.position.offset, self.num_replicas,
                                           self.rank, drop_last=self.drop_last))

    def set_epoch(self, epoch: int) -> None:
        """A new epoch starts its pass at offset 0; the current one (a loop that resumed inside
        it calls this again) keeps its position."""
        if epoch == self.position.epoch:
            return
        if self.resumed_epoch is not None and epoch < self.resumed_epoch:
            raise ValueError(
                f"sampler.set_epoch({epoch}) after the Session restored this sampler in epoch "
                f"{self.resumed_epoch}: it would train epochs it already trained. Start the "
                "epoch loop at `sampler.epoch` (read inside `with Session(...)`), e.g. "
                "`for epoch in range(sampler.epoch, EPOCHS)`")
        self.resumed_epoch = None
        self.epoch = epoch
        self.position = Position(epoch=epoch)

    def set_world(self, rank: int, world: int) -> None:
        """Split over `world` ranks from now on (DistributedSampler's sizes recomputed)."""
        self.rank, self.num_replicas = rank, world
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last and n % world:
            self.num_samples = math.ceil((n - world) / world)
        else:
            self.num_samples = math.ceil(n / world)
        self.total_size = self.num_samples * world

    def restore(self, position: Position) -> None:
        self.position = position
        self.epoch = position.epoch
        self.resumed_epoch = position.epoch


def adopt(sampler: DistributedSampler) -> ElasticSampler:  # type: ignore[type-arg]
    """Make `sampler` (a DistributedSampler, or an ElasticSampler being built) elastic, in
    place, and known to the Session's tracker."""
    from elastrain_trainer.loaders.tracking import tracker

    if not isinstance(sampler, ElasticSampler):
        sampler.__class__ = ElasticSampler
    assert isinstance(sampler, ElasticSampler)
    if getattr(sampler, "position", None) is None:
        sampler.position = Position(epoch=sampler.epoch)
        sampler.resumed_epoch = None
        tracker.add_sampler(sampler)
    return sampler
