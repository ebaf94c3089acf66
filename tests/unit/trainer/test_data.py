from __future__ import annotations

import random

import torch

from elastrain_trainer.data import (
    SyntheticDataset,
    TextDataset,
    generated_corpus,
    make_batch,
    micro_batch_indices,
)


def covered(start: int, global_batch: int, micro: int, world: int) -> list[int]:
    accum = global_batch // (micro * world)
    out: list[int] = []
    for rank in range(world):
        for k in range(accum):
            out += list(micro_batch_indices(start, micro, world, rank, k))
    return sorted(out)


def test_every_world_size_covers_the_same_global_batch_exactly_once() -> None:
    expected = list(range(80, 96))
    for world in (1, 2, 4, 8):
        assert covered(80, 16, 2, world) == expected


def test_samples_depend_only_on_seed_and_global_index() -> None:
    a, b = SyntheticDataset(16, seed=1), SyntheticDataset(16, seed=1)
    assert torch.equal(a.sample(12345), b.sample(12345))
    assert not torch.equal(a.sample(1), SyntheticDataset(16, seed=2).sample(1))


def test_text_windows_are_shuffled_per_epoch_and_cover_the_corpus() -> None:
    rng = random.Random(0)
    corpus = bytes(rng.randrange(256) for _ in range(512))
    ds = TextDataset(seq_len=15, seed=3, corpus=corpus)
    assert ds.windows == 32
    first_epoch = {bytes(ds.sample(i).tolist()) for i in range(32)}
    assert len(first_epoch) == 32 and ds.epoch_of(32) == 1


def test_corpus_is_stable_text() -> None:
    corpus = generated_corpus()
    assert len(corpus) == 1 << 18 and corpus == generated_corpus()
    assert corpus.decode().count(". ") > 1000


def test_batch_targets_are_inputs_shifted_by_one() -> None:
    x, y = make_batch(SyntheticDataset(8, seed=0), range(0, 3))
    assert x.shape == y.shape == (3, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])
