"""Token file parsing and validation (pure), and the dataset over a file:// token file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.data import build_dataset, make_batch, micro_batch_indices
from elastrain_trainer.tokenfiles import TokenFileDataset, TokenFileError, open_token_dataset
from elastrain_trainer.tokenfiles.dataset import GROUP_BLOCKS, block_lengths, epoch_order
from elastrain_trainer.tokenfiles.formats import (
    LLMC_HEADER_BYTES,
    TokenLayout,
    check_vocab,
    check_windows,
    parse_layout,
    probe_ranges,
)
from tests.token_files import llmc_bytes, nanogpt_bytes, pattern_tokens, write

URI = "s3://data/shard_000.bin"


def layout_of(data: bytes, fmt: str) -> TokenLayout:
    return parse_layout(URI, fmt, data[:LLMC_HEADER_BYTES], len(data))


@pytest.mark.parametrize(("layout", "itemsize"), [("gpt-2", 2), ("llama-3", 4)])
def test_llmc_header_gives_the_token_region(layout: str, itemsize: int) -> None:
    """Both layouts llm.c's write_datafile emits: gpt-2 (20240520, 1, uint16) and llama-3
    (20240801, 7, uint32)."""
    data = llmc_bytes(np.arange(100), layout)
    assert layout_of(data, "llmc") == TokenLayout(URI, LLMC_HEADER_BYTES, itemsize, 100)


def test_nanogpt_file_is_all_tokens() -> None:
    assert layout_of(nanogpt_bytes(np.arange(7)), "nanogpt") == TokenLayout(URI, 0, 2, 7)


@pytest.mark.parametrize(("data", "fmt", "problem"), [
    (llmc_bytes(np.arange(10), magic=12345), "llmc",
     "bad magic 12345 in the llm.c header (expected one of gpt-2: magic 20240520 version 1, "
     "uint16; llama-3: magic 20240801 version 7, uint32)"),
    (nanogpt_bytes(np.arange(600)), "llmc", "bad magic"),
    (llmc_bytes(np.arange(10), version=3), "llmc",
     "unsupported llm.c version 3 for magic 20240520 (gpt-2)"),
    # No writer emits these: uint32 under the gpt-2 magic, uint16 under llama-3's.
    (llmc_bytes(np.arange(10), "llama-3", magic=20240520, version=2), "llmc",
     "unsupported llm.c version 2 for magic 20240520"),
    (llmc_bytes(np.arange(10), version=7), "llmc",
     "unsupported llm.c version 7 for magic 20240520"),
    (llmc_bytes(np.arange(10), "llama-3", version=1), "llmc",
     "unsupported llm.c version 1 for magic 20240801 (llama-3)"),
    (llmc_bytes(np.arange(10))[:-1], "llmc",
     "truncated: the llm.c gpt-2 header declares 10 uint16 tokens (1044 bytes with the header) "
     "but the file is 1043 bytes"),
    (llmc_bytes(np.arange(10), "llama-3", declared=11), "llmc",
     "truncated: the llm.c llama-3 header declares 11 uint32 tokens"),
    (llmc_bytes(np.arange(10), declared=9), "llmc", "has trailing bytes"),
    (llmc_bytes(np.arange(10))[:100], "llmc", "100 bytes is shorter than the 1024-byte"),
    (llmc_bytes(np.arange(10), declared=0), "llmc", "declares 0 tokens"),
    (nanogpt_bytes(np.arange(10))[:-1], "nanogpt", "19 bytes is not a whole number of uint16"),
])
def test_a_bad_file_is_refused_naming_the_file_and_the_problem(
        data: bytes, fmt: str, problem: str) -> None:
    with pytest.raises(TokenFileError) as e:
        layout_of(data, fmt)
    assert str(e.value).startswith(f"{URI}: ")
    assert problem in str(e.value)


def test_a_file_shorter_than_one_sample_is_refused() -> None:
    with pytest.raises(TokenFileError, match=f"^{URI}: holds 8 tokens, fewer than one sample of "
                                             "seqLen \\+ 1 = 9$"):
        check_windows(TokenLayout(URI, 0, 2, 8), 8)
    assert check_windows(TokenLayout(URI, 0, 2, 27), 8) == 3


def test_a_token_id_at_or_past_the_vocabulary_is_refused_where_it_is() -> None:
    layout = TokenLayout(URI, 0, 2, 10)
    check_vocab(layout, np.array([1, 2, 255], dtype="<u2"), 0, 256)
    with pytest.raises(TokenFileError, match=f"^{URI}: token id 300 at token 41 is >= vocabSize "
                                             "256; .*\\(>= 301\\)$"):
        check_vocab(layout, np.array([1, 300, 2], dtype="<u2"), 40, 256)


def test_the_vocabulary_probe_reads_all_of_a_small_file_and_spans_of_a_large_one() -> None:
    assert probe_ranges(TokenLayout(URI, 0, 2, 1000), budget_tokens=1000) == [(0, 1000)]
    spans = probe_ranges(TokenLayout(URI, 0, 2, 10_000), budget_tokens=1600, chunks=16)
    assert len(spans) == 16 and all(n == 100 for _, n in spans)
    assert spans[0][0] == 0 and spans[-1][0] + 100 == 10_000  # first and last tokens covered
    assert sum(n for _, n in spans) <= 1600


@pytest.mark.parametrize(("fmt", "layout"), [("nanogpt", ""), ("llmc", "gpt-2"),
                                             ("llmc", "llama-3")])
def test_samples_are_windows_of_the_file_in_a_seeded_order(
        tmp_path: Path, fmt: str, layout: str) -> None:
    vocab = 70_000 if layout == "llama-3" else 300
    tokens = pattern_tokens(33 * 17, vocab)
    data = nanogpt_bytes(tokens) if fmt == "nanogpt" else llmc_bytes(tokens, layout)
    cfg = TrainerConfig(dataset=write(tmp_path / "t.bin", data), dataset_format=fmt,
                        vocab_size=vocab, seq_len=16)
    ds = build_dataset(cfg)
    assert isinstance(ds, TokenFileDataset) and ds.windows == 33
    windows = [ds.window_of(i) for i in range(33)]
    assert sorted(windows) == list(range(33)) and windows != list(range(33))
    for i in (0, 5, 32, 33, 70):
        w = ds.window_of(i)
        assert torch.equal(ds.sample(i), torch.from_numpy(tokens[w * 17:(w + 1) * 17]))
    assert ds.epoch_of(33) == 1 and [ds.window_of(33 + i) for i in range(33)] != windows
    again = build_dataset(cfg)
    assert all(torch.equal(ds.sample(i), again.sample(i)) for i in range(40))


def test_an_out_of_vocabulary_token_fails_at_open_naming_the_file(tmp_path: Path) -> None:
    tokens = pattern_tokens(400, 256)
    tokens[123] = 256
    uri = write(tmp_path / "train.bin", nanogpt_bytes(tokens))
    with pytest.raises(TokenFileError, match=f"^{uri}: token id 256 at token 123 is >= "):
        open_token_dataset(uri, "nanogpt", seq_len=8, seed=0, vocab_size=256,
                           global_batch_size=4)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/nope.bin"
    with pytest.raises(TokenFileError, match=f"^{uri}: cannot open: No such file"):
        open_token_dataset(uri, "nanogpt", seq_len=8, seed=0, vocab_size=256,
                           global_batch_size=4)


class CountingSource:
    """An in-memory remote source that counts reads (the prefetch path without a network)."""

    remote = True

    def __init__(self, data: bytes) -> None:
        self.uri, self.size, self.data, self.reads = URI, len(data), data, 0

    def read(self, start: int, end: int) -> bytes:
        self.reads += 1
        return self.data[start:end]


def test_an_epoch_permutes_windows_within_runs_of_a_few_random_blocks() -> None:
    k, runs = 5, GROUP_BLOCKS * 5
    lengths = block_lengths([103], k)
    order = epoch_order(lengths, seed=1, epoch=0)
    assert sorted(order.tolist()) == list(range(103))
    assert order.tolist() != list(range(103))
    for start in range(0, 103, runs):
        blocks = {w // k for w in order[start:start + runs].tolist()}
        assert len(blocks) <= GROUP_BLOCKS
    assert not torch.equal(order, epoch_order(lengths, seed=1, epoch=1))
    assert torch.equal(order, epoch_order(lengths, seed=1, epoch=0))


def test_a_remote_file_is_read_in_blocks_prefetched_for_the_next_steps_once_each() -> None:
    tokens = pattern_tokens(200 * 9, 256)
    source = CountingSource(nanogpt_bytes(tokens))
    layout = parse_layout(URI, "nanogpt", b"", source.size)
    # Three steps of this slot span 5 blocks: prefetch's bound (2 x 3 workers queued or being
    # read) takes them all however far the reads have got, so what is asked for never depends
    # on thread timing.
    ds = TokenFileDataset(source, layout, seq_len=8, seed=3, vocab_size=256,
                          global_batch_size=8, prefetch_steps=2, workers=3, block_bytes=4 * 18)
    assert ds.block_windows == 4
    ds.prefetch(micro_batch_indices(0, 2, 2, 1, 0))  # rank 1's first micro-batch of step 0
    slot = [2, 3, 10, 11, 18, 19]  # the same slot of steps 0, 1 and 2
    with ds._lock:
        assert set(ds._pending) | set(ds._cache) == {ds.window_of(i) // 4 for i in slot}
    for step in range(3):
        x, y = make_batch(ds, micro_batch_indices(step * 8, 2, 2, 1, 0))
        w = ds.window_of(step * 8 + 2)
        assert torch.equal(x[0], torch.from_numpy(tokens[w * 9:w * 9 + 8]))
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert ds._pool is not None
    ds._pool.shutdown(wait=True)
    # Each block read once (the cache holds them all): those of steps 0-4 for this slot.
    touched = {ds.window_of(i + step * 8) // 4 for step in range(5) for i in (2, 3)}
    assert source.reads == ds.fetches == len(touched)


@pytest.mark.parametrize(("fields", "message"), [
    ({"dataset": "gs://corpus/train.bin"}, "ELASTRAIN_DATASET ='gs://corpus/train.bin' must be"),
    ({"dataset": "s3://corpus"}, "or the URI of a token file"),
    ({"dataset": "text", "vocab_size": 100}, "ELASTRAIN_VOCAB_SIZE must be >= 256 for the byte"),
    ({"dataset": "file:///t.bin", "dataset_format": "parquet"},
     "ELASTRAIN_DATASET_FORMAT ='parquet' must be one of nanogpt, llmc"),
])
def test_the_config_refuses_what_no_dataset_can_read(fields: dict[str, object],
                                                     message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", "\\(")):
        TrainerConfig(**fields)  # type: ignore[arg-type]


EXIT_SCRIPT = """
import atexit, threading
from elastrain_trainer.tokenfiles import TokenFileDataset
from elastrain_trainer.tokenfiles.formats import parse_layout

started, release = threading.Semaphore(0), threading.Event()
reads = []

class Blocked:  # an object store whose reads finish only once the interpreter exits
    remote, uri, size = True, "s3://bucket/t.bin", 2 * 9 * 400
    def read(self, start, end):
        reads.append(start)
        started.release()
        release.wait(30)
        return bytes(end - start)

# Threading's exit hooks run newest first: the dataset's (registered below) drops the queue,
# then this one lets the reads in flight finish, then concurrent.futures joins the threads.
threading._register_atexit(release.set)
ds = TokenFileDataset(Blocked(), parse_layout(Blocked.uri, "nanogpt", b"", Blocked.size),
                      seq_len=8, seed=0, vocab_size=256, global_batch_size=8, workers=12,
                      block_bytes=18)
ds.prefetch(range(8))  # 24 one-window blocks queued on 12 threads
queued = len(ds._pending)
for _ in range(12):  # every thread is inside a read: the other 12 blocks are still queued
    assert started.acquire(timeout=30)
atexit.register(lambda: print(f"queued={queued} read={len(reads)}"))
"""


def test_queued_reads_are_dropped_at_exit(tmp_path: Path) -> None:
    """A SIGTERMed trainer exits after its save without waiting for read-ahead: the reads in
    flight finish, the queued ones never start (counted, not timed: a slow machine cannot
    pass or fail it)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    queued, read = (int(part.split("=")[1]) for part in out.split())
    assert (queued, read) == (24, 12), out
