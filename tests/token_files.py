"""Builders for token files in every layout the trainer reads (used by unit and integration
tests and the bench)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# llm.c's writer (dev/data/data_common.py, HEADERS_INFO): layout -> (magic, version, tokens)
LLMC_LAYOUTS = {"gpt-2": (20240520, 1, "<u2"), "llama-3": (20240801, 7, "<u4")}
LLMC_MAGIC = LLMC_LAYOUTS["gpt-2"][0]


def nanogpt_bytes(tokens: np.ndarray) -> bytes:
    """nanoGPT's train.bin: the tokens as headerless little-endian uint16."""
    return np.asarray(tokens, dtype="<u2").tobytes()


def llmc_bytes(tokens: np.ndarray, layout: str = "gpt-2", *, magic: int | None = None,
               version: int | None = None, declared: int | None = None) -> bytes:
    """A file as llm.c's write_datafile writes it: 256 x int32 header (magic, version, token
    count, zeros), then the tokens (gpt-2: uint16, llama-3: uint32). magic, version and declared
    override the header's fields (broken files)."""
    good_magic, good_version, dtype = LLMC_LAYOUTS[layout]
    header = np.zeros(256, dtype="<i4")
    header[:3] = (good_magic if magic is None else magic,
                  good_version if version is None else version,
                  len(tokens) if declared is None else declared)
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
