"""Builders for token files in both formats the trainer reads (used by unit and integration
tests and the bench)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

LLMC_MAGIC = 20240520


def nanogpt_bytes(tokens: np.ndarray) -> bytes:
    """nanoGPT's train.bin: the tokens as headerless little-endian uint16."""
    return np.asarray(tokens, dtype="<u2").tobytes()


def llmc_bytes(tokens: np.ndarray, version: int = 1, *, magic: int = LLMC_MAGIC,
               declared: int | None = None) -> bytes:
    """llm.c's shard: 256 x int32 header (magic, version, count), then uint16 (v1) / uint32 (v2)."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if declared is None else declared
    dtype = "<u2" if version == 1 else "<u4"
    return header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes()


def pattern_tokens(count: int, vocab: int, seed: int = 0, low: int = 0) -> np.ndarray:
    """Learnable tokens in [low, vocab): runs of 64 arithmetic sequences (start, stride random
    per run)."""
    rng = np.random.default_rng(seed)
    runs = -(-count // 64)
    start = rng.integers(0, vocab - low, size=(runs, 1))
    stride = rng.integers(1, 8, size=(runs, 1))
    out = low + (start + stride * np.arange(64)) % (vocab - low)
    return out.reshape(-1)[:count].astype(np.int64)


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return f"file://{path}"
