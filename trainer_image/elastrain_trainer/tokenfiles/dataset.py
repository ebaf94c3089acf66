"""Samples of a token file addressed by global index, with a bounded cache and prefetch.

Sample i is window order_e[i mod W] of the file (W whole windows of seq_len + 1 tokens, e the
epoch, order_e a permutation seeded by (seed, e)), so, as for the built-in datasets, the samples
a step sees depend only on the global index and a resume at any world size is exact.

For a remote file every sample is one ranged GET. A batch's reads are issued together, and
`prefetch` (called by data.make_batch with the batch's indices) also fetches the same slots of
the next `prefetch_steps` global batches (what this rank reads next at an unchanged world
size) on a thread pool, into an LRU cache bounded in bytes: the step waits on the network only
when the pool falls behind. A local file is memory-mapped; the page cache is its cache.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from elastrain_trainer.tokenfiles.formats import (
    LLMC_HEADER_BYTES,
    TokenLayout,
    check_vocab,
    check_windows,
    parse_layout,
    probe_ranges,
)
from elastrain_trainer.tokenfiles.sources import ByteSource, open_source

_MIX = 0x9E3779B97F4A7C15
# The vocabulary check at open reads at most this many bytes of tokens (the whole file when
# smaller; else 16 evenly spaced spans); every sample is checked again when it is read.
PROBE_BYTES = 16 << 20


class TokenFileDataset:
    """Windows of seq_len + 1 tokens of one token file, shuffled per epoch."""

    def __init__(self, source: ByteSource, layout: TokenLayout, *, seq_len: int, seed: int,
                 vocab_size: int, global_batch_size: int, cache_bytes: int = 256 << 20,
                 prefetch_steps: int = 2, workers: int = 8) -> None:
        self.source, self.layout = source, layout
        self.seq_len, self.seed, self.vocab_size = seq_len, seed, vocab_size
        self.windows = check_windows(layout, seq_len)
        self.global_batch_size = global_batch_size
        self.prefetch_steps = prefetch_steps if source.remote else 0
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._cached_bytes = 0
        self._pending: dict[int, Future[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._pool = (ThreadPoolExecutor(workers, thread_name_prefix="elastrain-data")
                      if source.remote else None)
        self.fetches = 0  # windows read from the source (for tests and the bench)
        self.waits = 0  # samples a step had to wait for

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one dataset per process, two epochs at most
    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * _MIX + epoch) % 2**63)
        return torch.randperm(self.windows, generator=g)

    def window_of(self, index: int) -> int:
        return int(self._order(index // self.windows)[index % self.windows])

    def epoch_of(self, index: int) -> int:
        return index // self.windows

    def check_vocab_at_open(self) -> None:
        """The sampled maximum token id (bounded by PROBE_BYTES) against vocab_size."""
        for first, count in probe_ranges(self.layout, PROBE_BYTES // self.layout.itemsize):
            check_vocab(self.layout, self._tokens(first, count), first, self.vocab_size)

    def _tokens(self, first: int, count: int) -> np.ndarray:
        start, end = self.layout.byte_range(first, count)
        return np.frombuffer(self.source.read(start, end), dtype=self.layout.dtype)

    def _fetch(self, window: int) -> torch.Tensor:
        n = self.seq_len + 1
        tokens = self._tokens(window * n, n)
        check_vocab(self.layout, tokens, window * n, self.vocab_size)
        self.fetches += 1
        return torch.from_numpy(tokens.astype(np.int64))

    def sample(self, index: int) -> torch.Tensor:
        window = self.window_of(index)
        if self._pool is None:
            return self._fetch(window)
        with self._lock:
            row = self._cache.pop(window, None)
            if row is not None:
                self._cached_bytes -= row.nbytes
                return row
            future = self._pending.pop(window, None)
        if future is None:
            self.waits += 1
            return self._fetch(window)
        if not future.done():
            self.waits += 1
        return future.result()

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start reading these samples and the same slots of the next prefetch_steps batches."""
        if self._pool is None:
            return
        ahead = [i + step * self.global_batch_size
                 for step in range(self.prefetch_steps + 1) for i in indices]
        for index in ahead:
            window = self.window_of(index)
            with self._lock:
                if window in self._cache or window in self._pending:
                    continue
                if self._cached_bytes + len(self._pending) * 8 * (self.seq_len + 1) \
                        >= self.cache_bytes:
                    return
                future = self._pool.submit(self._fetch, window)
                self._pending[window] = future
            future.add_done_callback(functools.partial(self._landed, window))

    def _landed(self, window: int, future: Future[torch.Tensor]) -> None:
        if future.exception() is not None:
            return  # sample() re-raises it to the step that needs the window
        with self._lock:
            if self._pending.get(window) is not future:
                return  # already handed to sample()
            del self._pending[window]
            row = future.result()
            self._cache[window] = row
            self._cached_bytes += row.nbytes
            while self._cached_bytes > self.cache_bytes and self._cache:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.nbytes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def open_token_dataset(uri: str, fmt: str, *, seq_len: int, seed: int, vocab_size: int,
                       global_batch_size: int, endpoint: str = "",
                       cache_bytes: int = 256 << 20, prefetch_steps: int = 2,
                       workers: int = 8) -> TokenFileDataset:
    """Open, validate (header, size, sampled vocabulary) and return the dataset."""
    source = open_source(uri, endpoint)
    header = bytes(source.read(0, min(source.size, LLMC_HEADER_BYTES))) if fmt == "llmc" else b""
    layout = parse_layout(uri, fmt, header, source.size)
    dataset = TokenFileDataset(source, layout, seq_len=seq_len, seed=seed, vocab_size=vocab_size,
                               global_batch_size=global_batch_size, cache_bytes=cache_bytes,
                               prefetch_steps=prefetch_steps, workers=workers)
    dataset.check_vocab_at_open()
    return dataset
