"""An IterableDataset that can seek by global index, split like a DistributedSampler.

A stream cannot be re-split by a sampler: each DataLoader worker iterates its own copy and the
script (or the stream) decides what each rank reads. One that can read its samples by position
(`read(positions)`: a shard reader seeking to a record, a tokenized corpus addressed by
sequence) declares its length and is split here exactly as `ElasticSampler(shuffle=False)`
splits a map-style dataset: rank r of a world of W reads positions `offset + r, offset + r + W,
...` of the epoch, padded at its end the same way, so a world change, a step redone and a resume
continue from the Session's position as for a sampler. With DataLoader workers, worker w of k
reads the rank's micro-batches w, w + k, ...: the DataLoader hands out an iterable dataset's
batches round-robin over its workers, so the rank's batches arrive in order.

    class Shards(IterableDataset):
        def __len__(self) -> int: ...                     # samples per epoch
        def read(self, positions: range) -> Iterator: ...  # those samples, in order

Any other IterableDataset is refused in process (loaders.tracking): nothing can tell what it
yields at another world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any, TypeGuard

from torch.utils.data import IterableDataset, get_worker_info

from elastrain_trainer.loaders.sampler import ElasticSampler

_ADOPTED: dict[type, type] = {}


def is_seekable(dataset: object) -> TypeGuard[IterableDataset[Any]]:
    """An IterableDataset that says its length and reads samples by global position."""
    return (isinstance(dataset, IterableDataset) and callable(getattr(dataset, "read", None))
            and callable(getattr(type(dataset), "__len__", None)))


class StreamLength(Sized):
    """What the stream's ElasticSampler splits: the stream's length, under its name (error
    messages name the dataset)."""

    def __init__(self, stream: IterableDataset, length: int) -> None:  # type: ignore[type-arg]
        self.name, self.length = type(stream).__name__, length

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return self.name


class ElasticStream(IterableDataset):  # type: ignore[type-arg]
    """What an adopted stream's class adds. Never instantiated: an adopted stream's class is
    `Elastic<its class>` with these methods and its own class as the only base."""

    elastic_sampler: ElasticSampler
    elastic_micro: int
    base: type

    def __iter__(self) -> Iterator[Any]:
        # In a worker this is the copy made when the DataLoader's iterator opened (a Pass
        # reopens it at a new world or position), so the sampler's world and offset are those.
        mine = list(self.elastic_sampler)  # this rank's positions to the epoch's end
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        micro = self.elastic_micro
        for batch in range(worker, math.ceil(len(mine) / micro), workers):
            for run in runs(mine[batch * micro:(batch + 1) * micro]):
                yield from self.read(run)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        """This rank's samples in an epoch at the current world (what DataLoader's len() and
        its length check read), as a DistributedSampler's len()."""
        return int(self.elastic_sampler.num_samples)


_METHODS = {name: ElasticStream.__dict__[name] for name in ("__iter__", "__len__")}


def runs(positions: list[int]) -> list[range]:
    """`positions` as ranges of one stride each (a rank's positions are one stride, the
    world size, except where the epoch's padding wraps to its start)."""
    found: list[range] = []
    start = 0
    while start < len(positions):
        end = start + 1
        step = positions[end] - positions[start] if end < len(positions) else 1
        if step > 0:
            while end < len(positions) and positions[end] - positions[end - 1] == step:
                end += 1
        else:
            step = 1
        found.append(range(positions[start], positions[end - 1] + 1, step))
        start = end
    return found


def adopt_stream(stream: IterableDataset, micro: int) -> ElasticSampler:  # type: ignore[type-arg]
    """Make `stream` read by the Session's position, in place; returns its position's sampler
    (registered with the tracker like a script's DistributedSampler)."""
    if "base" not in type(stream).__dict__:
        length = len(stream)  # type: ignore[arg-type]
        cls = type(stream)
        if cls not in _ADOPTED:
            _ADOPTED[cls] = type(f"Elastic{cls.__name__}", (cls,), {**_METHODS, "base": cls})
        sampler = ElasticSampler(StreamLength(stream, length), shuffle=False)
        stream.__class__ = _ADOPTED[cls]
        stream.elastic_sampler = sampler  # type: ignore[attr-defined]
    stream.elastic_micro = micro  # type: ignore[attr-defined]
    return stream.elastic_sampler  # type: ignore[attr-defined, no-any-return]
