"""Token file layouts and their validation: pure functions of bytes, sizes and names.

- nanoGPT (`prepare.py` -> `train.bin`): a headerless array of little-endian uint16 tokens.
- llm.c (`dev/data/data_common.py`, `write_datafile`): 256 little-endian int32 (magic, version,
  token count, then zeros), then the tokens. Its writer emits two layouts (HEADERS_INFO there):
  "gpt-2", magic 20240520 version 1, uint16 tokens; "llama-3", magic 20240801 version 7, uint32
  tokens (what its `train_llama3.py` reader asserts). Nothing else is an llm.c token file.

Every error is a TokenFileError (a ValueError) whose message starts with the file's URI and
says what is wrong with it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

FORMATS = ("nanogpt", "llmc")
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
# (magic, version) -> (llm.c's name for the layout, bytes per token)
LLMC_LAYOUTS = {(20240520, 1): ("gpt-2", 2), (20240801, 7): ("llama-3", 4)}
LLMC_MAGICS = {magic: name for (magic, _), (name, _) in LLMC_LAYOUTS.items()}
_KNOWN = "; ".join(f"{name}: magic {m} version {v}, uint{8 * size}"
                   for (m, v), (name, size) in LLMC_LAYOUTS.items())


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
    if magic not in LLMC_MAGICS:
        raise TokenFileError(f"{uri}: bad magic {magic} in the llm.c header (expected one of "
                             f"{_KNOWN}); a headerless nanoGPT file needs datasetFormat nanogpt")
    if (magic, version) not in LLMC_LAYOUTS:
        raise TokenFileError(f"{uri}: unsupported llm.c version {version} for magic {magic} "
                             f"({LLMC_MAGICS[magic]}); llm.c's writer emits {_KNOWN}")
    if count <= 0:
        raise TokenFileError(f"{uri}: the llm.c header declares {count} tokens")
    name, itemsize = LLMC_LAYOUTS[magic, version]
    expected = LLMC_HEADER_BYTES + count * itemsize
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise TokenFileError(
            f"{uri}: {what}: the llm.c {name} header declares {count} uint{8 * itemsize} tokens "
            f"({expected} bytes with the header) but the file is {size} bytes")
    return TokenLayout(uri, LLMC_HEADER_BYTES, itemsize, count)


def header_bytes(fmt: str) -> int:
    """How many leading bytes parse_layout needs of a file in this format."""
    return LLMC_HEADER_BYTES if fmt == "llmc" else 0


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
