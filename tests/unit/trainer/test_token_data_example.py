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
from elastrain_trainer.data import build_dataset
from elastrain_trainer.tokenfiles import TokenFileDataset

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "token-data"


@pytest.mark.parametrize("fmt", ["nanogpt", "llmc"])
def test_prepared_file_is_read_back_as_the_input_bytes(tmp_path: Path, fmt: str) -> None:
    trainer = yaml.safe_load((EXAMPLE / "job.yaml").read_text())["spec"]["trainer"]
    text = (EXAMPLE.parents[1] / "README.md").read_bytes()
    out = tmp_path / "train.bin"
    done = subprocess.run([sys.executable, str(EXAMPLE / "prepare.py"), str(EXAMPLE.parents[1] /
                           "README.md"), str(out), "--format", fmt],
                          capture_output=True, text=True, timeout=60, check=True)
    assert f"{len(text)} tokens ({fmt}" in done.stdout
    cfg = TrainerConfig(dataset=f"file://{out}", dataset_format=fmt,
                        vocab_size=trainer["vocabSize"], seq_len=trainer["seqLen"])
    ds = build_dataset(cfg)
    assert isinstance(ds, TokenFileDataset)
    span = trainer["seqLen"] + 1
    assert ds.windows == len(text) // span
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    for i in (0, 1, ds.windows - 1):
        w = ds.window_of(i)
        assert torch.equal(ds.sample(i).long(), torch.from_numpy(tokens[w * span:(w + 1) * span]))


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
    assert list(header[:3]) == [20240520, 2, 3]
    assert list(np.fromfile(tmp_path / "b.bin", dtype="<u4", offset=1024)) == [1, 70_000, 3]
