"""Which samples a rank reads: the arithmetic of a sampler that survives a world change.

An epoch is one order of the dataset's indices (`epoch_order`: exactly what torch's
DistributedSampler draws for that seed and epoch). A global step consumes a contiguous run of
*positions* in that order, whatever the world: rank r of a world of W reads positions
`offset + r, offset + r + W, ...` (DistributedSampler's own interleaving), so the ranks'
micro-batches of one step together cover `micro * W * accum` consecutive positions. The only
state that moves is the epoch and the offset (positions of the epoch consumed so far), which
mean the same at every world size: a world that changes at a step boundary continues from the
same offset, and every index of the epoch is read exactly once. The epoch's tail is what
DistributedSampler does with it at the world that reaches it: padded with the epoch's first
indices to a multiple of W, or dropped (`drop_last`).

Pure functions: tested without processes (tests/unit/trainer/test_loader_positions.py).
"""

from __future__ import annotations

import math

import torch


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The dataset's indices in the order DistributedSampler(shuffle, seed).set_epoch(epoch)
    draws them (before its padding)."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def pass_length(n: int, offset: int, world: int, *, drop_last: bool) -> int:
    """Positions a world of `world` reads from `offset` to the epoch's end, padding included
    (a multiple of `world`)."""
    remaining = max(0, n - offset)
    if drop_last:
        return remaining // world * world
    return math.ceil(remaining / world) * world


def rank_positions(n: int, offset: int, world: int, rank: int, *, drop_last: bool) -> range:
    """The positions rank `rank` reads, in order, from `offset` to the epoch's end. A position
    past n is padding: it reads the epoch's position `p % n`, as DistributedSampler pads."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    return range(offset + rank, offset + pass_length(n, offset, world, drop_last=drop_last),
                 world)


def rank_indices(order: list[int], offset: int, world: int, rank: int, *,
                 drop_last: bool) -> list[int]:
    """The dataset indices rank `rank` reads from `offset` to the epoch's end."""
    n = len(order)
    return [order[p % n] for p in rank_positions(n, offset, world, rank, drop_last=drop_last)]


def offset_after(start: int, batches: int, micro: int, world: int, length: int) -> int:
    """The epoch's offset once every rank drew `batches` micro-batches of `micro` samples in a
    pass that began at `start` and reads `length` positions (its last batch may be short)."""
    return start + min(batches * micro * world, length)

