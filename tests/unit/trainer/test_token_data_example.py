"""examples/token-data: prepare.py writes files the trainer reads as the example job declares
them (its format, vocabulary and sequence length), sample for sample the input's bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.data import build_dataset, build_validation_dataset
from elastrain_trainer.tokenfiles import TokenFileDataset

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "token-data"


@pytest.mark.parametrize("fmt", ["nanogpt", "llmc"])
def test_prepared_file_is_read_back_as_the_input_bytes(tmp_path: Path, fmt: str) -> None:
    trainer = yaml.safe_load((EXAMPLE / "job.yaml").read_text())["spec"]["trainer"]
    text = (EXAMPLE.parents[1] / "README.md").read_bytes()
    done = subprocess.run([sys.executable, str(EXAMPLE / "prepare.py"), str(EXAMPLE.parents[1] /
                           "README.md"), str(tmp_path), "--format", fmt],
                          capture_output=True, text=True, timeout=60, check=True)
    assert f"{len(text)} tokens ({fmt}, bytes" in done.stdout
    cfg = TrainerConfig(dataset=f"file://{tmp_path}/train_*.bin", dataset_format=fmt,
                        vocab_size=trainer["vocabSize"], seq_len=trainer["seqLen"])
    ds = build_dataset(cfg)
    assert isinstance(ds, TokenFileDataset)
    span = trainer["seqLen"] + 1
    assert ds.windows == len(text) // span
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    for i in (0, 1, ds.windows - 1):
        w = ds.window_of(i)
        assert torch.equal(ds.sample(i).long(), torch.from_numpy(tokens[w * span:(w + 1) * span]))


def test_shards_and_a_validation_split_read_back_in_order(tmp_path: Path) -> None:
    # A fixed length of the README's text: its last shard holds at least one sample whatever the
    # README's length (seen failing on a README whose last shard held 58 tokens).
    text = (EXAMPLE.parents[1] / "README.md").read_bytes()[:3000 + 5 * 5000 + 2600]
    source = tmp_path / "input.txt"
    source.write_bytes(text)
    subprocess.run([sys.executable, str(EXAMPLE / "prepare.py"), str(source), str(tmp_path),
                    "--format", "llmc", "--shard-tokens", "5000", "--val-tokens", "3000"],
                   capture_output=True, text=True, timeout=60, check=True)
    train = sorted(tmp_path.glob("train_*.bin"))
    assert len(train) == -(-(len(text) - 3000) // 5000)
    cfg = TrainerConfig(dataset=f"file://{tmp_path}/train_*.bin", dataset_format="llmc",
                        seq_len=64, validation_dataset=f"file://{tmp_path}/val_*.bin")
    ds, val = build_dataset(cfg), build_validation_dataset(cfg)
    assert isinstance(ds, TokenFileDataset) and isinstance(val, TokenFileDataset)
    assert val.windows == 3000 // 65
    assert ds.windows == sum(min(5000, len(text) - 3000 - i) // 65
                             for i in range(0, len(text) - 3000, 5000))


def test_ids_that_do_not_fit_uint16_need_llmc(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import prepare  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLE))
    ids = np.array([1, 70_000, 3], dtype=np.int64)
    with pytest.raises(ValueError, match="use --format llmc"):
        prepare.write_tokens(ids, tmp_path / "a.bin", "nanogpt")
    prepare.write_tokens(ids, tmp_path / "b.bin", "llmc")
    header = np.fromfile(tmp_path / "b.bin", dtype="<i4", count=256)
    assert list(header[:3]) == [20240801, 7, 3]  # llm.c's llama-3 layout
    assert list(np.fromfile(tmp_path / "b.bin", dtype="<u4", offset=1024)) == [1, 70_000, 3]
