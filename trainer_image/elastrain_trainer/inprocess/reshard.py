"""Which rows of an FSDP2-sharded tensor go where when the world changes (pure; section 5).

FSDP2 shards every parameter (and AdamW's moments, which follow it) on dim 0 as `torch.chunk`
does: at world `n` each chunk has `ceil(rows / n)` rows, rank `r` holds rows
`[r * c, min((r + 1) * c, rows))`, the last ranks possibly none. A *layout* is the nodes holding
those chunks, in rank order. Moving from one layout to another is then arithmetic: each node of
the target layout needs one row range, which overlaps the chunks of a few holders. A node that
holds nothing (a joiner) is simply not in the holding layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def chunk_rows(rows: int, world: int, index: int) -> tuple[int, int]:
    """Rows `[start, stop)` of chunk `index` of `rows` split over `world` (torch.chunk)."""
    if world < 1 or not 0 <= index < world:
        raise ValueError(f"chunk {index} of a world of {world}")
    size = -(-rows // world)  # ceil; 0 rows: every chunk empty
    return min(index * size, rows), min((index + 1) * size, rows)


@dataclass(frozen=True, order=True)
class Move:
    """Rows `[start, stop)` of one tensor, from the node holding them to the node needing them
    (the same node: a local copy)."""

    src: str
    dst: str
    start: int
    stop: int


def row_moves(rows: int, held: Sequence[str], target: Sequence[str]) -> list[Move]:
    """The moves that give each node of `target` its chunk of a tensor of `rows` rows, whose
    chunks the nodes of `held` hold (every row in exactly one holder). Sorted, so every node
    derives the same list (the order in which the rows are packed on the wire)."""
    if len(set(held)) != len(held) or len(set(target)) != len(target):
        raise ValueError(f"a node twice in a layout: {list(held)} -> {list(target)}")
    if not held:
        raise ValueError("no node holds the rows")
    holders = [(node, *chunk_rows(rows, len(held), i)) for i, node in enumerate(held)]
    moves = []
    for j, dst in enumerate(target):
        want_start, want_stop = chunk_rows(rows, len(target), j)
        for src, start, stop in holders:
            lo, hi = max(start, want_start), min(stop, want_stop)
            if lo < hi:
                moves.append(Move(src, dst, lo, hi))
    return sorted(moves)
