"""Write a token file the built-in trainer reads (`trainer.dataset` + `datasetFormat`).

    python examples/token-data/prepare.py INPUT.txt train.bin [--format nanogpt|llmc]

This one tokenizes by bytes (vocabulary 256: `vocabSize: 256`), so it runs anywhere with numpy.
With a real tokenizer, write its ids the same way: for nanoGPT `np.asarray(ids, np.uint16)
.tofile(path)` (GPT-2's 50257 ids fit; `vocabSize: 50304`), for llm.c the 256 x int32 header
(magic 20240520, version 1 for uint16 or 2 for uint32 ids, the token count) then the ids.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

LLMC_MAGIC, LLMC_HEADER_INTS = 20240520, 256


def write_tokens(ids: np.ndarray, path: Path, fmt: str) -> None:
    """Writes `ids` (non-negative integers) as a nanoGPT or llm.c token file."""
    wide = int(ids.max(initial=0)) >= 2**16
    if fmt == "nanogpt":
        if wide:
            raise ValueError("nanoGPT files hold uint16 ids; use --format llmc for larger ones")
        ids.astype("<u2").tofile(path)
        return
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:3] = (LLMC_MAGIC, 2 if wide else 1, len(ids))
    with open(path, "wb") as out:
        out.write(header.tobytes())
        out.write(ids.astype("<u4" if wide else "<u2").tobytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", type=Path, help="a text (or any) file")
    parser.add_argument("output", type=Path)
    parser.add_argument("--format", choices=("nanogpt", "llmc"), default="nanogpt")
    args = parser.parse_args(argv)
    ids = np.frombuffer(args.input.read_bytes(), dtype=np.uint8)
    write_tokens(ids, args.output, args.format)
    print(f"{args.output}: {len(ids)} tokens ({args.format}, vocabulary 256)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
