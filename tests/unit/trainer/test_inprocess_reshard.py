"""inprocess.reshard, pure: FSDP2's row chunks and the moves between two layouts (docs/recovery.md
section 5). torch.chunk is the reference for the chunks; the moves must give every node of the
target exactly its chunk, each row once, from the node that holds it."""

from __future__ import annotations

import itertools

import pytest
import torch

from elastrain_trainer.inprocess.reshard import Move, chunk_rows, row_moves


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 7, 64, 255, 256, 1000])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
def test_chunks_are_torch_chunk_and_fsdp2s_empty_tail(rows: int, world: int) -> None:
    ref = [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(rows).chunk(world) if len(c)]
    got = [chunk_rows(rows, world, i) for i in range(world)]
    assert [g for g in got if g[0] < g[1]] == ref
    # ranks past torch.chunk's last chunk hold nothing (FSDP2 pads them to an empty shard)
    assert all(start == stop == rows for start, stop in got[len(ref):])


def covered(moves: list[Move], rows: int, held: list[str],
            target: list[str]) -> dict[str, list[int]]:
    """Check every move's source holds its rows; return the rows each target node receives."""
    got: dict[str, list[int]] = {n: [] for n in target}
    for mv in moves:
        start, stop = chunk_rows(rows, len(held), held.index(mv.src))
        assert start <= mv.start < mv.stop <= stop, mv
        got[mv.dst] += range(mv.start, mv.stop)
    return got


@pytest.mark.parametrize(("held", "target"), [
    (["a", "b", "c"], ["a", "b"]),            # c leaves (the handover on the old group)
    (["a", "b", "c"], ["a", "c"]),            # b, in the middle, leaves
    (["a", "b"], ["a", "b", "d"]),            # d joins, holding nothing
    (["a"], ["a", "b", "c", "d"]),            # a start: rank 0's whole model to everyone
    (["c", "b", "a"], ["b", "a", "d"]),       # ranks reordered, a leave and a join at once
    (["a", "b", "c", "d"], ["d"]),            # down to one
])
@pytest.mark.parametrize("rows", [1, 5, 7, 64, 257])
def test_each_target_node_gets_exactly_its_chunk(held: list[str], target: list[str],
                                                 rows: int) -> None:
    got = covered(row_moves(rows, held, target), rows, held, target)
    for j, node in enumerate(target):
        start, stop = chunk_rows(rows, len(target), j)
        assert sorted(got[node]) == list(range(start, stop)), node


def test_rows_a_survivor_already_holds_stay_local() -> None:
    # 7 rows: a [0,3) b [3,6) c [6,7) -> a [0,4) b [4,7): a keeps 0-2, gets 3 from b; b keeps
    # 4-5, gets 6 from c (the leaver hands over its only row).
    assert row_moves(7, ["a", "b", "c"], ["a", "b"]) == [
        Move("a", "a", 0, 3), Move("b", "a", 3, 4), Move("b", "b", 4, 6), Move("c", "b", 6, 7)]


def test_every_node_derives_the_same_sorted_moves() -> None:
    for held, target in itertools.permutations([["a", "b", "c"], ["b", "c", "d"]]):
        moves = row_moves(100, held, target)
        assert moves == sorted(moves) == row_moves(100, list(held), tuple(target))


def test_refused_layouts() -> None:
    with pytest.raises(ValueError, match="twice"):
        row_moves(4, ["a", "a"], ["a"])
    with pytest.raises(ValueError, match="no node holds"):
        row_moves(4, [], ["a"])
    with pytest.raises(ValueError, match="chunk 2 of a world of 2"):
        chunk_rows(4, 2, 2)
