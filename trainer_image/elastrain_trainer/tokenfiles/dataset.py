"""Samples of one or many token files (shards) addressed by global index, read in blocks,
cached and prefetched.

Each shard is cut into windows of seq_len + 1 tokens on its own: a window never spans two shards
(the < seq_len + 1 tokens at a shard's end are not trained on, as llm.c's and nanoGPT's loaders
also drop them). Windows are numbered across the shards in their sorted order, and each shard's
windows are cut into blocks of about BLOCK_BYTES (a block never spans shards either). Each
epoch's order permutes all blocks, then shuffles the windows inside each run of GROUP_BLOCKS
consecutive blocks of that permutation, all from a generator seeded by (seed, epoch). Sample i
is window order_e[i mod W]: as for the built-in datasets, what a step sees depends only on the
global index and the sorted list of shards, so a resume at any world size is exact.

The block locality is what makes object storage usable: a ranged GET costs ~a millisecond of
client CPU whatever its size, so one GET per sample caps a 2-core worker at a few hundred
samples/s (bench/token_dataset.py), while one GET per block amortises it over ~500 samples.
A batch still mixes GROUP_BLOCKS random places of the dataset (the trade every sharded loader
makes, e.g. llm.c's shard + in-shard shuffle).

For remote shards, `prefetch` (called by data.make_batch with a batch's indices) fetches, on a
thread pool, the blocks of those samples and of the same slots in the next `prefetch_steps`
global batches (what this rank reads next at an unchanged world size), into an LRU cache
bounded in bytes. A local file is memory-mapped; the page cache is its cache.

Opening reads only headers (ranged GETs in parallel; sources.open_sources lists a glob once)
and a bounded vocabulary probe spread over up to PROBE_SHARDS shards; every block or sample is
checked again when read, so a bad id in a shard the probe missed fails naming that shard.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from elastrain_trainer.tokenfiles.formats import (
    TokenFileError,
    TokenLayout,
    check_vocab,
    check_windows,
    header_bytes,
    parse_layout,
    probe_ranges,
)
from elastrain_trainer.tokenfiles.sources import ByteSource, open_sources, parallel_map

_MIX = 0x9E3779B97F4A7C15
BLOCK_BYTES = 1 << 20
GROUP_BLOCKS = 8
# The vocabulary check at open reads at most this many bytes of tokens in all (whole shards when
# they fit; else evenly spaced spans) from at most PROBE_SHARDS evenly spaced shards.
PROBE_BYTES = 16 << 20
PROBE_SHARDS = 16


def block_lengths(shard_windows: Sequence[int], block_windows: int) -> list[int]:
    """Windows per block, blocks in global window order, no block across two shards."""
    out: list[int] = []
    for windows in shard_windows:
        full, rest = divmod(windows, block_windows)
        out += [block_windows] * full + ([rest] if rest else [])
    return out


def epoch_order(blocks: Sequence[int], seed: int, epoch: int) -> torch.Tensor:
    """The global window of each position in one epoch: blocks (their window counts in global
    window order) permuted, windows shuffled within runs of GROUP_BLOCKS blocks."""
    g = torch.Generator().manual_seed((seed * _MIX + epoch) % 2**63)
    lengths = torch.tensor(blocks, dtype=torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    perm = torch.randperm(len(blocks), generator=g)
    lens = lengths[perm]
    total = int(lens.sum())
    offsets = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    order = torch.repeat_interleave(starts[perm], lens) + offsets
    run = torch.repeat_interleave(torch.arange(len(blocks)) // GROUP_BLOCKS, lens)
    keys = run.double() + torch.rand(total, generator=g, dtype=torch.float64)
    return order[torch.argsort(keys, stable=True)]


class TokenFileDataset:
    """Windows of seq_len + 1 tokens of one or more token files, shuffled per epoch
    (block-local)."""

    def __init__(self, sources: ByteSource | Sequence[ByteSource],
                 layouts: TokenLayout | Sequence[TokenLayout], *, seq_len: int, seed: int,
                 vocab_size: int, global_batch_size: int, cache_bytes: int = 256 << 20,
                 prefetch_steps: int = 2, workers: int = 8,
                 block_bytes: int = BLOCK_BYTES) -> None:
        self.sources = list(sources) if isinstance(sources, Sequence) else [sources]
        self.layouts = list(layouts) if isinstance(layouts, Sequence) else [layouts]
        assert self.sources and len(self.sources) == len(self.layouts)
        sources, layouts = self.sources, self.layouts
        self.seq_len, self.seed, self.vocab_size = seq_len, seed, vocab_size
        shard_windows = [check_windows(layout, seq_len) for layout in layouts]
        itemsize = max(layout.itemsize for layout in layouts)
        self.block_windows = max(1, block_bytes // ((seq_len + 1) * itemsize))
        self.blocks = block_lengths(shard_windows, self.block_windows)
        self.windows = sum(shard_windows)
        # First global window and first global block of each shard.
        self._first_window = [0, *itertools.accumulate(shard_windows)][:-1]
        self._first_block = [0, *itertools.accumulate(
            -(-w // self.block_windows) for w in shard_windows)][:-1]
        self.global_batch_size = global_batch_size
        self.prefetch_steps = prefetch_steps
        self.cache_bytes = cache_bytes
        self.workers = workers
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cached_bytes = 0
        self._pending: dict[int, Future[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._pool = (ThreadPoolExecutor(workers, thread_name_prefix="elastrain-data")
                      if any(s.remote for s in sources) else None)
        if self._pool is not None:
            # At exit (after a SIGTERM save, say) drop queued reads before the interpreter joins
            # the pool's threads: these hooks run newest first, before concurrent.futures' own.
            getattr(threading, "_register_atexit", lambda f: None)(self.close)
        self.fetches = 0  # blocks (remote) or windows (local) read from the sources
        self.waits = 0  # samples whose block was not in the cache when a step asked

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one dataset per process, two epochs at most
    def _order(self, epoch: int) -> torch.Tensor:
        return epoch_order(self.blocks, self.seed, epoch)

    def window_of(self, index: int) -> int:
        """The global window (across shards, in their sorted order) of sample `index`."""
        return int(self._order(index // self.windows)[index % self.windows])

    def epoch_of(self, index: int) -> int:
        return index // self.windows

    def locate(self, window: int) -> tuple[int, int]:
        """(shard, window within the shard) of a global window."""
        shard = bisect.bisect_right(self._first_window, window) - 1
        return shard, window - self._first_window[shard]

    def block_of(self, window: int) -> int:
        shard, local = self.locate(window)
        return self._first_block[shard] + local // self.block_windows

    def check_vocab_at_open(self) -> None:
        """The sampled maximum token id against vocab_size: PROBE_BYTES in all, over at most
        PROBE_SHARDS evenly spaced shards (first and last included), read in parallel."""
        n = len(self.layouts)
        picked = sorted({round(i * (n - 1) / max(1, PROBE_SHARDS - 1))
                         for i in range(min(n, PROBE_SHARDS))})
        spans = []
        for shard in picked:
            layout = self.layouts[shard]
            budget = PROBE_BYTES // len(picked) // layout.itemsize
            spans += [(shard, first, count) for first, count in
                      probe_ranges(layout, budget, chunks=max(1, 16 // len(picked)))]

        def probe(span: tuple[int, int, int]) -> None:
            shard, first, count = span
            check_vocab(self.layouts[shard], self._tokens(shard, first, count), first,
                        self.vocab_size)

        parallel_map(probe, spans)

    def _tokens(self, shard: int, first: int, count: int) -> np.ndarray:
        layout = self.layouts[shard]
        start, end = layout.byte_range(first, count)
        return np.frombuffer(self.sources[shard].read(start, end), dtype=layout.dtype)

    def _fetch(self, shard: int, first: int, count: int) -> np.ndarray:
        tokens = self._tokens(shard, first, count)
        check_vocab(self.layouts[shard], tokens, first, self.vocab_size)
        self.fetches += 1
        return tokens

    def _fetch_block(self, block: int) -> np.ndarray:
        n = self.seq_len + 1
        shard = bisect.bisect_right(self._first_block, block) - 1
        first = (block - self._first_block[shard]) * self.block_windows
        return self._fetch(shard, first * n, self.blocks[block] * n)

    def sample(self, index: int) -> torch.Tensor:
        window = self.window_of(index)
        n = self.seq_len + 1
        shard, local = self.locate(window)
        if not self.sources[shard].remote:
            tokens = self._fetch(shard, local * n, n)
        else:
            at = local % self.block_windows
            tokens = self._block(self.block_of(window))[at * n:(at + 1) * n]
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
        future = self._pool.submit(self._read_block, block)
        self._pending[block] = future
        return future

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start reading these samples and the same slots of the next prefetch_steps batches."""
        if self._pool is None:
            return
        windows = (self.window_of(i + step * self.global_batch_size)
                   for step in range(self.prefetch_steps + 1) for i in indices)
        blocks = dict.fromkeys(self.block_of(w) for w in windows
                               if self.sources[self.locate(w)[0]].remote)
        with self._lock:
            for block in blocks:
                if len(self._pending) >= 2 * self.workers:
                    return  # the next call asks again
                if block not in self._cache and block not in self._pending:
                    self._submit(block)

    def _read_block(self, block: int) -> np.ndarray:
        """On the pool: the block leaves _pending (into the cache, or, if the read failed, for a
        step to fetch it again and see the error) before its future resolves. As a done-callback
        this waited for the lock after the step already had the block, and until then the read,
        though over, counted against prefetch's bound: whether a later step's block was asked
        for turned on thread timing."""
        tokens = None
        try:
            tokens = self._fetch_block(block)
            return tokens
        finally:
            with self._lock:
                del self._pending[block]
                if tokens is not None:
                    self._keep(block, tokens)

    def _keep(self, block: int, tokens: np.ndarray) -> None:
        self._cache[block] = tokens
        self._cached_bytes += tokens.nbytes
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def read_layouts(sources: Sequence[ByteSource], fmt: str) -> list[TokenLayout]:
    """Each shard's layout from its header (one ranged GET each, in parallel); the first bad
    shard in sorted order is the one named."""
    need = header_bytes(fmt)

    def layout(source: ByteSource) -> TokenLayout:
        try:
            header = bytes(source.read(0, min(source.size, need))) if need else b""
        except TokenFileError:
            raise
        except Exception as e:  # the store's own error (boto3's): name the shard
            raise TokenFileError(f"{source.uri}: cannot read its header: {e}") from e
        return parse_layout(source.uri, fmt, header, source.size)

    return parallel_map(layout, sources)


def open_token_dataset(uri: str, fmt: str, *, seq_len: int, seed: int, vocab_size: int,
                       global_batch_size: int, endpoint: str = "",
                       cache_bytes: int = 256 << 20, prefetch_steps: int = 2,
                       workers: int = 8) -> TokenFileDataset:
    """Open (one URI, a glob or a comma-separated list of them), validate (headers, sizes,
    sampled vocabulary) and return the dataset."""
    sources = open_sources(uri, endpoint)
    layouts = read_layouts(sources, fmt)
    dataset = TokenFileDataset(sources, layouts, seq_len=seq_len, seed=seed,
                               vocab_size=vocab_size, global_batch_size=global_batch_size,
                               cache_bytes=cache_bytes, prefetch_steps=prefetch_steps,
                               workers=workers)
    dataset.check_vocab_at_open()
    return dataset
