"""Write token files the built-in trainer reads (`trainer.dataset` + `datasetFormat`), in shards,
with a validation split (`trainer.validation`).

    python examples/token-data/prepare.py INPUT.txt OUT_DIR [--format nanogpt|llmc]
        [--tokenizer bytes|gpt2] [--shard-tokens N] [--val-tokens N]

writes OUT_DIR/train_000000.bin, train_000001.bin, ... (each at most --shard-tokens tokens) and,
with --val-tokens, OUT_DIR/val_000000.bin from the end of the text. Upload the directory and
point the job at `s3://bucket/prefix/train_*.bin` and `validation.dataset:
s3://bucket/prefix/val_*.bin` (globs are listed once, shards sorted by name).

Tokenizers:
- bytes (default): the text's bytes, vocabulary 256 (`vocabSize: 256`); numpy only, offline.
- gpt2: GPT-2's BPE through tiktoken (`pip install tiktoken`; `vocabSize: 50304`). tiktoken
  ships its code but not the encodings: the first use downloads GPT-2's vocab.bpe and
  encoder.json from openaipublic.blob.core.windows.net into TIKTOKEN_CACHE_DIR. Offline, copy a
  cache made on a machine with network (`TIKTOKEN_CACHE_DIR=/path/to/cache`). `tokenizers` and
  `transformers` are no better offline: GPT-2's tokenizer.json comes from the Hugging Face hub
  (`HF_HUB_OFFLINE=1` only works with a filled cache).

Layouts (`--format`): nanogpt is headerless uint16 (nanoGPT's prepare.py); llmc is llm.c's
`write_datafile`: a 256 x int32 header (magic, version, token count) then the ids, "gpt-2"
(magic 20240520, version 1, uint16) when every id fits 16 bits, else "llama-3" (magic 20240801,
version 7, uint32).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

LLMC_HEADER_INTS = 256
# llm.c's dev/data/data_common.py HEADERS_INFO: layout -> (magic, version, token dtype)
LLMC_LAYOUTS = {"gpt-2": (20240520, 1, "<u2"), "llama-3": (20240801, 7, "<u4")}


def write_tokens(ids: np.ndarray, path: Path, fmt: str) -> None:
    """Writes `ids` (non-negative integers) as a nanoGPT or llm.c token file."""
    wide = int(ids.max(initial=0)) >= 2**16
    if fmt == "nanogpt":
        if wide:
            raise ValueError("nanoGPT files hold uint16 ids; use --format llmc for larger ones")
        ids.astype("<u2").tofile(path)
        return
    magic, version, dtype = LLMC_LAYOUTS["llama-3" if wide else "gpt-2"]
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, len(ids))
    with open(path, "wb") as out:
        out.write(header.tobytes())
        out.write(ids.astype(dtype).tobytes())


def tokenize(text: bytes, tokenizer: str) -> np.ndarray:
    if tokenizer == "bytes":
        return np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    import tiktoken  # type: ignore[import-not-found]

    encoding = tiktoken.get_encoding("gpt2")  # downloads the encoding once (see the docstring)
    ids = encoding.encode_ordinary(text.decode("utf-8", errors="replace"))
    return np.asarray([*ids, encoding.eot_token], dtype=np.int64)


def write_shards(ids: np.ndarray, out: Path, stem: str, fmt: str,
                 shard_tokens: int) -> list[Path]:
    """ids cut into files stem_000000.bin, ... of at most shard_tokens tokens each."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, start in enumerate(range(0, len(ids), shard_tokens)):
        path = out / f"{stem}_{i:06d}.bin"
        write_tokens(ids[start:start + shard_tokens], path, fmt)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", type=Path, help="a text (or any) file")
    parser.add_argument("output", type=Path, help="a directory for the shards")
    parser.add_argument("--format", choices=("nanogpt", "llmc"), default="nanogpt")
    parser.add_argument("--tokenizer", choices=("bytes", "gpt2"), default="bytes")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000,
                        help="tokens per shard (FineWeb's llm.c shards hold 100M)")
    parser.add_argument("--val-tokens", type=int, default=0,
                        help="tokens from the end of the text for val_*.bin (0: none)")
    args = parser.parse_args(argv)
    ids = tokenize(args.input.read_bytes(), args.tokenizer)
    cut = len(ids) - args.val_tokens
    train, val = ids[:cut], ids[cut:]
    paths = write_shards(train, args.output, "train", args.format, args.shard_tokens)
    if len(val):
        paths += write_shards(val, args.output, "val", args.format, args.shard_tokens)
    vocab = 256 if args.tokenizer == "bytes" else 50304
    print(f"{args.output}: {len(ids)} tokens ({args.format}, {args.tokenizer}, vocabSize "
          f"{vocab}) in {len(paths)} files: {', '.join(p.name for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
