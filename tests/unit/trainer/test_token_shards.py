"""Sharded token datasets on file://: which files a dataset value names, in which order, how
samples are addressed across shards, and the order of an epoch over uneven blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.data import build_dataset, build_validation_dataset, micro_batch_indices
from elastrain_trainer.tokenfiles import TokenFileDataset, TokenFileError, open_token_dataset
from elastrain_trainer.tokenfiles.dataset import GROUP_BLOCKS, block_lengths, epoch_order
from tests.token_files import llmc_bytes, pattern_tokens

SEQ = 8  # windows of 9 tokens


def write_shards(root: Path, sizes: list[int], layout: str = "llama-3") -> list[np.ndarray]:
    """Shards train_000.bin ... of these token counts (distinct values per shard)."""
    parts = []
    for i, size in enumerate(sizes):
        tokens = (pattern_tokens(size, 200, seed=i) + 1000 * i).astype(np.int64)
        (root / f"train_{i:03d}.bin").write_bytes(llmc_bytes(tokens, layout))
        parts.append(tokens)
    return parts


def test_a_glob_and_a_list_name_the_same_shards_in_sorted_order(tmp_path: Path) -> None:
    write_shards(tmp_path, [100, 50, 77])
    (tmp_path / "val_000.bin").write_bytes(llmc_bytes(np.arange(90), "llama-3"))
    by_glob = open_token_dataset(f"file://{tmp_path}/train_*.bin", "llmc", seq_len=SEQ, seed=1,
                                 vocab_size=5000, global_batch_size=4)
    listed = ", ".join(f"file://{tmp_path}/train_{i:03d}.bin" for i in (2, 0, 1, 0))
    by_list = open_token_dataset(listed, "llmc", seq_len=SEQ, seed=1, vocab_size=5000,
                                 global_batch_size=4)
    mixed = open_token_dataset(f"file://{tmp_path}/train_00[12].bin,file://{tmp_path}/"
                               "train_000.bin", "llmc", seq_len=SEQ, seed=1, vocab_size=5000,
                               global_batch_size=4)
    expected = [f"file://{tmp_path}/train_{i:03d}.bin" for i in range(3)]
    assert [s.uri for s in by_glob.sources] == [s.uri for s in by_list.sources] == expected
    assert [s.uri for s in mixed.sources] == expected
    assert all(torch.equal(by_glob.sample(i), by_list.sample(i)) for i in range(40))


def test_a_window_never_spans_two_shards(tmp_path: Path) -> None:
    """Each shard is cut on its own: 100 tokens give 11 windows of 9 (1 token dropped), 50 give
    5 (5 dropped), 77 give 8 (5 dropped); sample i is a window of one shard."""
    parts = write_shards(tmp_path, [100, 50, 77])
    ds = open_token_dataset(f"file://{tmp_path}/*.bin", "llmc", seq_len=SEQ, seed=3,
                            vocab_size=5000, global_batch_size=4)
    assert ds.windows == 11 + 5 + 8
    assert [ds.locate(w) for w in (0, 10, 11, 15, 16, 23)] == [
        (0, 0), (0, 10), (1, 0), (1, 4), (2, 0), (2, 7)]
    seen = set()
    for i in range(ds.windows):
        shard, local = ds.locate(ds.window_of(i))
        expected = parts[shard][local * 9:(local + 1) * 9]
        assert torch.equal(ds.sample(i), torch.from_numpy(expected))
        seen.add(ds.window_of(i))
    assert seen == set(range(ds.windows))  # an epoch is every window once


def test_every_world_size_reads_the_same_global_batch(tmp_path: Path) -> None:
    """What a resume at another world size relies on: a step's samples are its global indices."""
    write_shards(tmp_path, [300, 120, 250, 90])
    ds = open_token_dataset(f"file://{tmp_path}/*.bin", "llmc", seq_len=SEQ, seed=5,
                            vocab_size=5000, global_batch_size=8)
    start = 8 * 11

    def batch(world: int, micro: int) -> list[int]:
        accum = 8 // (micro * world)
        idx = [i for rank in range(world) for k in range(accum)
               for i in micro_batch_indices(start, micro, world, rank, k)]
        return sorted(ds.window_of(i) for i in idx)

    assert batch(1, 8) == batch(2, 2) == batch(4, 1) == batch(8, 1)


def test_an_epoch_over_uneven_blocks_covers_every_window_in_runs_of_few_blocks() -> None:
    lengths = block_lengths([23, 5, 14], 4)
    assert lengths == [4, 4, 4, 4, 4, 3, 4, 1, 4, 4, 4, 2]
    order = epoch_order(lengths, seed=2, epoch=0).tolist()
    assert sorted(order) == list(range(42)) and order != list(range(42))
    starts = np.cumsum([0, *lengths])
    block = [int(np.searchsorted(starts, w, side="right")) - 1 for w in order]
    permuted = list(dict.fromkeys(block))  # runs are contiguous: first sightings keep run order
    at = 0
    for first in range(0, len(lengths), GROUP_BLOCKS):
        run = permuted[first:first + GROUP_BLOCKS]
        size = sum(lengths[b] for b in run)
        assert set(block[at:at + size]) == set(run)  # a run's windows come from its blocks only
        at += size
    assert epoch_order(lengths, seed=2, epoch=0).tolist() == order


def test_a_bad_shard_is_refused_naming_it(tmp_path: Path) -> None:
    write_shards(tmp_path, [100, 50, 77, 60])
    bad = tmp_path / "train_002.bin"
    bad.write_bytes(bad.read_bytes()[:-4])
    with pytest.raises(TokenFileError, match=f"^file://{bad}: truncated: the llm.c llama-3 "):
        open_token_dataset(f"file://{tmp_path}/train_*.bin", "llmc", seq_len=SEQ, seed=1,
                           vocab_size=5000, global_batch_size=4)


def test_a_bad_token_in_a_shard_the_probe_skipped_fails_when_read_naming_it(
        tmp_path: Path) -> None:
    """Opening probes a bounded sample; every window is checked again when read."""
    parts = write_shards(tmp_path, [100] * 40, layout="gpt-2")
    parts[17][50] = 60_000
    (tmp_path / "train_017.bin").write_bytes(llmc_bytes(parts[17], "gpt-2"))
    ds = open_token_dataset(f"file://{tmp_path}/*.bin", "llmc", seq_len=SEQ, seed=1,
                            vocab_size=50_000, global_batch_size=4)
    bad = next(i for i in range(ds.windows) if ds.locate(ds.window_of(i)) == (17, 5))
    with pytest.raises(TokenFileError, match=f"^file://{tmp_path}/train_017.bin: token id 60000"):
        ds.sample(bad)


@pytest.mark.parametrize(("value", "problem"), [
    ("file://{root}/none_*.bin", "matches no token file"),
    ("file://{root}/train_000.bin, gs://b/x.bin", "gs://b/x.bin: a token file must be"),
])
def test_what_names_no_file_is_refused(tmp_path: Path, value: str, problem: str) -> None:
    write_shards(tmp_path, [100])
    with pytest.raises(TokenFileError, match=problem):
        open_token_dataset(value.format(root=tmp_path), "llmc", seq_len=SEQ, seed=1,
                           vocab_size=5000, global_batch_size=4)


def test_the_config_takes_globs_lists_and_a_validation_split(tmp_path: Path) -> None:
    write_shards(tmp_path, [100, 50])
    cfg = TrainerConfig(dataset=f"file://{tmp_path}/train_*.bin", dataset_format="llmc",
                        vocab_size=5000, seq_len=SEQ,
                        validation_dataset=f"file://{tmp_path}/train_001.bin")
    train, val = build_dataset(cfg), build_validation_dataset(cfg)
    assert isinstance(train, TokenFileDataset) and isinstance(val, TokenFileDataset)
    assert (train.windows, val.windows) == (16, 5)
    assert build_validation_dataset(TrainerConfig()) is None
    with pytest.raises(ValueError, match="ELASTRAIN_VALIDATION_DATASET ='text' must be empty"):
        TrainerConfig(validation_dataset="text")
    with pytest.raises(ValueError, match="ELASTRAIN_VALIDATION_BATCHES must be >= 1"):
        TrainerConfig(validation_batches=0)
    with pytest.raises(ValueError, match="or a comma-separated list"):
        TrainerConfig(dataset="file:///a.bin,,text")
