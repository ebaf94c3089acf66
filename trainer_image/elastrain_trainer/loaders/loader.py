"""A DataLoader whose iteration survives a world change.

A DataLoader reads its sampler ahead: its worker processes hold `prefetch_factor` batches per
worker already drawn for the old world. So the Session cannot only re-split the sampler; each
pass over an adopted loader (`iter(loader)`, `for batch in loader`) is a `Pass` that counts the
batches it handed out, keeps the sampler's offset, and when the world changed or the position
was restored (a heal, a step redone after a lost peer) drops the DataLoader's iterator and
opens a new one at the current offset and world. The script's own iterator object stays valid.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from elastrain_trainer.loaders import positions
from elastrain_trainer.loaders.sampler import ElasticSampler

_ADOPTED: dict[type, type] = {}


class ElasticLoader(DataLoader):  # type: ignore[type-arg]
    """What an adopted DataLoader's class adds: `iter()` gives a Pass. Never instantiated: an
    adopted loader's class is `Elastic<its class>`, made with these methods, whose only base
    is the loader's own class (a class swap needs the same base and layout)."""

    elastic_sampler: ElasticSampler
    base: type  # the loader's own class

    def __iter__(self) -> Pass:  # type: ignore[override]
        return Pass(self)

    def base_iter(self) -> Iterator[Any]:
        return self.base.__iter__(self)  # type: ignore[attr-defined, no-any-return]

    @property
    def micro_batch(self) -> int:
        size = self.batch_size if self.batch_size is not None else (
            getattr(self.batch_sampler, "batch_size", 1))
        return int(size)


_METHODS = {name: ElasticLoader.__dict__[name] for name in ("__iter__", "base_iter",
                                                            "micro_batch")}


def is_adopted(loader: object) -> bool:
    return "base" in type(loader).__dict__ and "base_iter" in type(loader).__dict__


def sampler_of(loader: DataLoader) -> Any:  # type: ignore[type-arg]
    """The per-sample sampler the loader batches (batch_size=..., or a BatchSampler's)."""
    inner = getattr(loader.batch_sampler, "sampler", None)
    return inner if inner is not None else loader.sampler


def adopt_loader(loader: DataLoader, sampler: ElasticSampler) -> ElasticLoader:  # type: ignore[type-arg]
    """Make `loader` (whose sampler is `sampler`) iterate in Passes, in place."""
    if not is_adopted(loader):
        cls = type(loader)
        if cls not in _ADOPTED:
            _ADOPTED[cls] = type(f"Elastic{cls.__name__}", (cls,), {**_METHODS, "base": cls})
        loader.__class__ = _ADOPTED[cls]
    loader.elastic_sampler = sampler  # type: ignore[attr-defined]
    return loader  # type: ignore[return-value]


class Pass(Iterator[Any]):
    """One iteration over an adopted loader, from the sampler's offset to its epoch's end."""

    def __init__(self, loader: ElasticLoader) -> None:
        from elastrain_trainer.loaders.tracking import tracker

        self.loader, self.tracker = loader, tracker
        self.sampler = loader.elastic_sampler
        pos = self.sampler.position
        if not (pos.in_pass and self.sampler.resumed_epoch is not None):
            # A new pass; only the first one after a resume continues the saved one.
            pos.offset = 0
        self.sampler.resumed_epoch = None
        self.sampler.passes += 1
        pos.in_pass = True
        self._open()

    def _open(self) -> None:
        sampler = self.sampler
        self.version = self.tracker.version
        self.start, self.drawn = sampler.position.offset, 0
        self.length = positions.pass_length(len(sampler.dataset), self.start,  # type: ignore[arg-type]
                                            sampler.num_replicas, drop_last=sampler.drop_last)
        self.micro = self.loader.micro_batch
        self.world = sampler.num_replicas
        sampler.pass_end = self.start + self.length
        self.it = self.loader.base_iter()

    def __next__(self) -> Any:
        pos = self.sampler.position
        if self.version != self.tracker.version:  # a new world, or the position restored
            self.it = iter(())  # the old iterator's workers end with it
            if not pos.in_pass:
                raise StopIteration
            self._open()
        try:
            batch = next(self.it)
        except StopIteration:
            pos.in_pass = False
            raise
        self.drawn += 1
        pos.offset = positions.offset_after(self.start, self.drawn, self.micro, self.world,
                                            self.length)
        return batch

