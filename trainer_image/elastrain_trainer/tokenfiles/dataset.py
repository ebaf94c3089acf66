"""Samples of a token file addressed by global index, read in blocks, cached and prefetched.

The file is cut into windows of seq_len + 1 tokens, and the windows into blocks of about
BLOCK_BYTES. Each epoch's order permutes the blocks, then shuffles the windows inside each run
of GROUP_BLOCKS consecutive blocks of that permutation, all from a generator seeded by
(seed, epoch). Sample i is window order_e[i mod W]: as for the built-in datasets, what a step
sees depends only on the global index, so a resume at any world size is exact.

The block locality is what makes object storage usable: a ranged GET costs ~a millisecond of
client CPU whatever its size, so one GET per sample caps a 2-core worker at a few hundred
samples/s (bench/token_dataset.py), while one GET per block amortises it over ~500 samples.
A batch still mixes GROUP_BLOCKS random places of the file (the trade every sharded loader
makes, e.g. llm.c's shard + in-shard shuffle).

For a remote file, `prefetch` (called by data.make_batch with a batch's indices) fetches, on a
thread pool, the blocks of those samples and of the same slots in the next `prefetch_steps`
global batches (what this rank reads next at an unchanged world size), into an LRU cache
bounded in bytes. A local file is memory-mapped; the page cache is its cache.
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
BLOCK_BYTES = 1 << 20
GROUP_BLOCKS = 8
# The vocabulary check at open reads at most this many bytes of tokens (the whole file when
# smaller; else 16 evenly spaced spans); every block or sample is checked again when read.
PROBE_BYTES = 16 << 20


def epoch_order(windows: int, block_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """The window of each position in one epoch: blocks permuted, windows shuffled within runs
    of GROUP_BLOCKS blocks."""
    g = torch.Generator().manual_seed((seed * _MIX + epoch) % 2**63)
    blocks = -(-windows // block_windows)
    perm = torch.randperm(blocks, generator=g)
    order = (perm[:, None] * block_windows + torch.arange(block_windows)[None, :]).flatten()
    order = order[order < windows]
    run = torch.arange(windows) // (GROUP_BLOCKS * block_windows)
    keys = run.double() + torch.rand(windows, generator=g, dtype=torch.float64)
    return order[torch.argsort(keys, stable=True)]


class TokenFileDataset:
    """Windows of seq_len + 1 tokens of one token file, shuffled per epoch (block-local)."""

    def __init__(self, source: ByteSource, layout: TokenLayout, *, seq_len: int, seed: int,
                 vocab_size: int, global_batch_size: int, cache_bytes: int = 256 << 20,
                 prefetch_steps: int = 2, workers: int = 8,
                 block_bytes: int = BLOCK_BYTES) -> None:
        self.source, self.layout = source, layout
        self.seq_len, self.seed, self.vocab_size = seq_len, seed, vocab_size
        self.windows = check_windows(layout, seq_len)
        self.block_windows = max(1, block_bytes // ((seq_len + 1) * layout.itemsize))
        self.global_batch_size = global_batch_size
        self.prefetch_steps = prefetch_steps
        self.cache_bytes = cache_bytes
        self.workers = workers
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cached_bytes = 0
        self._pending: dict[int, Future[np.ndarray]] = {}
        # Reentrant: a future that is already done runs its callback (_landed) in submit().
        self._lock = threading.RLock()
        self._pool = (ThreadPoolExecutor(workers, thread_name_prefix="elastrain-data")
                      if source.remote else None)
        if self._pool is not None:
            # At exit (after a SIGTERM save, say) drop queued reads before the interpreter joins
            # the pool's threads: these hooks run newest first, before concurrent.futures' own.
            getattr(threading, "_register_atexit", lambda f: None)(self.close)
        self.fetches = 0  # blocks (remote) or windows (local) read from the source
        self.waits = 0  # samples whose block was not in the cache when a step asked

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one dataset per process, two epochs at most
    def _order(self, epoch: int) -> torch.Tensor:
        return epoch_order(self.windows, self.block_windows, self.seed, epoch)

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

    def _fetch(self, first: int, count: int) -> np.ndarray:
        tokens = self._tokens(first, count)
        check_vocab(self.layout, tokens, first, self.vocab_size)
        self.fetches += 1
        return tokens

    def _fetch_block(self, block: int) -> np.ndarray:
        n = self.seq_len + 1
        first = block * self.block_windows
        last = min(first + self.block_windows, self.windows)
        return self._fetch(first * n, (last - first) * n)

    def sample(self, index: int) -> torch.Tensor:
        window = self.window_of(index)
        n = self.seq_len + 1
        if self._pool is None:
            tokens = self._fetch(window * n, n)
        else:
            block, at = divmod(window, self.block_windows)
            tokens = self._block(block)[at * n:(at + 1) * n]
        return torch.from_numpy(tokens.astype(np.int64))

    def _block(self, block: int) -> np.ndarray:
        with self._lock:
            tokens = self._cache.get(block)
            if tokens is not None:
                self._cache.move_to_end(block)
                return tokens
            future = self._pending.get(block) or self._submit(block)
            self.waits += 1
        return future.result()

    def _submit(self, block: int) -> Future[np.ndarray]:
        assert self._pool is not None
        future = self._pool.submit(self._fetch_block, block)
        self._pending[block] = future
        future.add_done_callback(functools.partial(self._landed, block))
        return future

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start reading these samples and the same slots of the next prefetch_steps batches."""
        if self._pool is None:
            return
        blocks = dict.fromkeys(self.window_of(i + step * self.global_batch_size)
                               // self.block_windows
                               for step in range(self.prefetch_steps + 1) for i in indices)
        with self._lock:
            for block in blocks:
                if len(self._pending) >= 2 * self.workers:
                    return  # the next call asks again
                if block not in self._cache and block not in self._pending:
                    self._submit(block)

    def _landed(self, block: int, future: Future[np.ndarray]) -> None:
        with self._lock:
            if self._pending.get(block) is future:
                del self._pending[block]
            if future.cancelled() or future.exception() is not None:
                return  # a step that needs the block fetches it again (and sees the error)
            tokens = future.result()
            if block not in self._cache:
                self._cache[block] = tokens
                self._cached_bytes += tokens.nbytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
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
