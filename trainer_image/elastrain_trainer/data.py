"""Datasets addressed by GLOBAL sample index, and the split of a global batch across ranks.

The sample order is a function of (seed, global index) only. Step s consumes the global
indices [samples_seen, samples_seen + global_batch), so a resumed run (at any world size)
sees exactly the samples an uninterrupted run would have seen; the data position saved
in a checkpoint is just `samples_seen`.

ELASTRAIN_DATASET is `synthetic`, `text` (both bytes, vocabulary 256) or token files (file:// or
s3:// URIs or globs, comma-separated; format ELASTRAIN_DATASET_FORMAT; see
elastrain_trainer.tokenfiles). ELASTRAIN_VALIDATION_DATASET names a validation split the same way.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from typing import Protocol

import torch

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.presets import VOCAB_SIZE

# Large odd multiplier so neighbouring (seed, index) pairs give unrelated generator seeds.
_MIX = 0x9E3779B97F4A7C15
_WORDS = (
    "the", "a", "one", "every", "some", "wind", "river", "stone", "light", "ship", "crew",
    "engine", "model", "worker", "node", "step", "checkpoint", "cluster", "signal", "night",
    "morning", "storm", "harbour", "valley", "train", "learns", "waits", "saves", "resumes",
    "sails", "carries", "rests", "shines", "falls", "rises", "quickly", "slowly", "again",
    "together", "alone", "under", "over", "beside", "through", "across", "before", "after",
    "while", "because", "and", "but", "so", "then",
)


class Dataset(Protocol):
    """An endless sequence of token windows of length seq_len + 1 (input and shifted target)."""

    def sample(self, index: int) -> torch.Tensor: ...

    def epoch_of(self, index: int) -> int: ...

    def prefetch(self, indices: Sequence[int]) -> None:
        """A hint: these samples (and the same slots of the next batches) are read next."""


class SyntheticDataset:
    """Arithmetic byte sequences (start, stride drawn per sample): learnable and deterministic."""

    def __init__(self, seq_len: int, seed: int) -> None:
        self.seq_len = seq_len
        self.seed = seed

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * _MIX + index) % 2**63)
        start, stride = torch.randint(0, VOCAB_SIZE, (2,), generator=g).tolist()
        stride = 1 + stride % 15
        t = torch.arange(self.seq_len + 1)
        row: torch.Tensor = (start + stride * t) % VOCAB_SIZE
        return row

    def epoch_of(self, index: int) -> int:
        return 0

    def prefetch(self, indices: Sequence[int]) -> None:
        return None


class TextDataset:
    """Byte-level windows of a generated English-like corpus, shuffled per epoch."""

    def __init__(self, seq_len: int, seed: int, corpus: bytes | None = None) -> None:
        self.seq_len = seq_len
        self.seed = seed
        data = corpus if corpus is not None else generated_corpus()
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.windows = len(self.tokens) // (seq_len + 1)
        if self.windows < 1:
            raise ValueError(f"ELASTRAIN_SEQ_LEN={seq_len} is longer than the text corpus")

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one dataset per process, two epochs at most
    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * _MIX + epoch) % 2**63)
        return torch.randperm(self.windows, generator=g)

    def sample(self, index: int) -> torch.Tensor:
        window = int(self._order(index // self.windows)[index % self.windows])
        start = window * (self.seq_len + 1)
        return self.tokens[start:start + self.seq_len + 1]

    def epoch_of(self, index: int) -> int:
        return index // self.windows

    def prefetch(self, indices: Sequence[int]) -> None:
        return None


@functools.lru_cache(maxsize=1)
def generated_corpus(size: int = 1 << 18) -> bytes:
    """A fixed pseudo-English text (same bytes on every machine and Python 3 version)."""
    rng = random.Random(20240611)
    parts: list[str] = []
    length = 0
    while length < size:
        words = [_WORDS[rng.randrange(len(_WORDS))] for _ in range(4 + rng.randrange(9))]
        sentence = " ".join(words).capitalize() + ". "
        parts.append(sentence)
        length += len(sentence)
    return "".join(parts).encode()[:size]


def build_dataset(cfg: TrainerConfig) -> Dataset:
    """The dataset cfg names, opened and validated (a token file's errors name the file)."""
    if cfg.dataset == "synthetic":
        return SyntheticDataset(cfg.seq_len, cfg.seed)
    if cfg.dataset == "text":
        return TextDataset(cfg.seq_len, cfg.seed)
    return _token_files(cfg, cfg.dataset)


def build_validation_dataset(cfg: TrainerConfig) -> Dataset | None:
    """The validation split cfg names (None for none), opened and validated like the training
    set. Its order is seeded too: every evaluation reads the same samples."""
    return _token_files(cfg, cfg.validation_dataset) if cfg.validation_dataset else None


def _token_files(cfg: TrainerConfig, uris: str) -> Dataset:
    from elastrain_trainer.tokenfiles import open_token_dataset
    return open_token_dataset(
        uris, cfg.dataset_format, seq_len=cfg.seq_len, seed=cfg.seed,
        vocab_size=cfg.vocab_size, global_batch_size=cfg.global_batch_size,
        endpoint=cfg.checkpoint_endpoint, cache_bytes=cfg.dataset_cache_bytes,
        prefetch_steps=cfg.dataset_prefetch_steps)


def micro_batch_indices(start: int, micro: int, world: int, rank: int, k: int) -> range:
    """Global indices of micro-batch k of `rank` in the global batch that begins at `start`.

    Micro-batches interleave ranks (k * world + rank), so every (world, accum) split of
    the same global batch covers the same indices exactly once.
    """
    first = start + (k * world + rank) * micro
    return range(first, first + micro)


def make_batch(dataset: Dataset, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape [len(indices), seq_len]."""
    dataset.prefetch(indices)
    rows = torch.stack([dataset.sample(i) for i in indices])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
