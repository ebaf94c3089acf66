"""Token file layouts and their validation: pure functions of bytes, sizes and names.

- nanoGPT (`prepare.py` -> `train.bin`): a headerless array of little-endian uint16 tokens.
- llm.c (`dev/data/*.bin`): 256 little-endian int32 (magic 20240520, version, token count,
  then zeros), then the tokens: uint16 in version 1 (GPT-2), uint32 in version 2 (Llama 3).

Every error is a TokenFileError (a ValueError) whose message starts with the file's URI and
says what is wrong with it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

FORMATS = ("nanogpt", "llmc")
LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
LLMC_ITEMSIZE = {1: 2, 2: 4}  # version -> bytes per token


class TokenFileError(ValueError):
    """A token file that cannot be trained on, and why."""


@dataclass(frozen=True)
class TokenLayout:
    """Where the tokens of a file are: `count` tokens of `itemsize` bytes from byte `offset`."""

    uri: str
    offset: int
    itemsize: int
    count: int

    @property
    def dtype(self) -> np.dtype[np.unsignedinteger]:
        return np.dtype("<u2" if self.itemsize == 2 else "<u4")

    def byte_range(self, first_token: int, tokens: int) -> tuple[int, int]:
        """[start, end) byte offsets of `tokens` tokens from token `first_token`."""
        start = self.offset + first_token * self.itemsize
        return start, start + tokens * self.itemsize


def parse_nanogpt(uri: str, size: int) -> TokenLayout:
    """The layout of a headerless uint16 file of `size` bytes."""
    if size % 2:
        raise TokenFileError(f"{uri}: {size} bytes is not a whole number of uint16 tokens "
                             "(truncated, or not a nanoGPT token file)")
    return TokenLayout(uri, 0, 2, size // 2)


def parse_llmc(uri: str, header: bytes, size: int) -> TokenLayout:
    """The layout of an llm.c file of `size` bytes whose first bytes are `header`."""
    if size < LLMC_HEADER_BYTES or len(header) < LLMC_HEADER_BYTES:
        raise TokenFileError(f"{uri}: {size} bytes is shorter than the {LLMC_HEADER_BYTES}-byte "
                             "llm.c header (truncated, or not an llm.c token file)")
    magic, version, count = struct.unpack_from("<3i", header)
    if magic != LLMC_MAGIC:
        raise TokenFileError(f"{uri}: bad magic {magic} in the llm.c header (expected "
                             f"{LLMC_MAGIC}); a headerless nanoGPT file needs datasetFormat "
                             "nanogpt")
    if version not in LLMC_ITEMSIZE:
        raise TokenFileError(f"{uri}: unsupported llm.c version {version} (1: uint16 tokens, "
                             "2: uint32 tokens)")
    if count <= 0:
        raise TokenFileError(f"{uri}: the llm.c header declares {count} tokens")
    itemsize = LLMC_ITEMSIZE[version]
    expected = LLMC_HEADER_BYTES + count * itemsize
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise TokenFileError(
            f"{uri}: {what}: the llm.c header declares {count} uint{8 * itemsize} tokens "
            f"({expected} bytes with the header) but the file is {size} bytes")
    return TokenLayout(uri, LLMC_HEADER_BYTES, itemsize, count)


def parse_layout(uri: str, fmt: str, header: bytes, size: int) -> TokenLayout:
    """Dispatch on the declared format (headers cannot tell a nanoGPT file apart reliably)."""
    if fmt == "nanogpt":
        return parse_nanogpt(uri, size)
    if fmt == "llmc":
        return parse_llmc(uri, header, size)
    raise TokenFileError(f"{uri}: unknown token file format {fmt!r} (one of {', '.join(FORMATS)})")


def check_windows(layout: TokenLayout, seq_len: int) -> int:
    """How many whole windows of seq_len + 1 tokens the file holds (at least one)."""
    windows = layout.count // (seq_len + 1)
    if windows < 1:
        raise TokenFileError(f"{layout.uri}: holds {layout.count} tokens, fewer than one sample "
                             f"of seqLen + 1 = {seq_len + 1}")
    return windows


def check_vocab(layout: TokenLayout, tokens: np.ndarray, first_token: int,
                vocab_size: int) -> None:
    """Refuse token ids the model's embedding cannot index, saying where the first one is."""
    if tokens.size == 0:
        return
    top = int(tokens.max())
    if top >= vocab_size:
        at = first_token + int(np.argmax(tokens >= vocab_size))
        raise TokenFileError(f"{layout.uri}: token id {int(tokens[at - first_token])} at token "
                             f"{at} is >= vocabSize {vocab_size}; set spec.trainer.vocabSize "
                             f"above the tokenizer's largest id (>= {top + 1})")


def probe_ranges(layout: TokenLayout, budget_tokens: int,
                 chunks: int = 16) -> list[tuple[int, int]]:
    """(first_token, tokens) spans to read for the vocabulary check at open: the whole file when
    it fits the budget, else `chunks` evenly spaced spans that together fit it."""
    if layout.count <= budget_tokens:
        return [(0, layout.count)]
    span = max(1, budget_tokens // chunks)
    stride = (layout.count - span) // max(1, chunks - 1)
    return [(i * stride, span) for i in range(chunks)]
