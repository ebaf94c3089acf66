"""Sharded token datasets on the real MinIO: start-up time and samples/s for 1, 10 and 100 shards
against one file of the same total size, measured side by side in one run.

    .venv/bin/python bench/token_shards.py [--pairs 5] [--tokens 33554432] [--samples 4096]
        [--seq-len 1024] [--out bench/results/token_shards.json]

A FineWeb-10B-shaped layout scaled down: llm.c gpt-2 shards (FineWeb's are 100M tokens each,
`fineweb_train_000001.bin` ...) of --tokens in all, listed through the glob
`s3://bucket/prefix/fineweb_train_*.bin`, beside one `fineweb_one.bin` of the same tokens. Uses
ELASTRAIN_S3_ENDPOINT (+ _ACCESS_KEY, _SECRET_KEY, _BUCKET) when set, else starts MinIO through
hack/cluster.py (bench/s3_target.py). Trials interleave (one file, 10 shards, 100 shards, 1
shard via its glob, ...) --pairs times; each opens a fresh dataset (list, header GETs, vocabulary
probe: "open s") and reads --samples samples from a new global index through data.make_batch
(micro-batches of 8, world size 1, read-ahead on: "samples/s"). Prints medians with min-max and
each layout's ratio to the one file, and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from s3_target import s3_target  # noqa: E402

from tests.token_files import llmc_bytes, pattern_tokens  # noqa: E402

MICRO, ACCUM = 8, 4
LAYOUTS = ("one file", "1 shard", "10 shards", "100 shards")


def upload(args: argparse.Namespace, endpoint: str,
           bucket: str) -> tuple[dict[str, str], list[str]]:
    """The dataset value of each layout, and every key written."""
    from elastrain_trainer.checkpoint.s3 import S3Storage

    prefix = f"bench-shards/{uuid.uuid4().hex[:8]}"
    store = S3Storage(f"s3://{bucket}", endpoint_url=endpoint)
    tokens = pattern_tokens(args.tokens, 50257)
    keys = [f"{prefix}/fineweb_one.bin"]
    store.write(keys[0], llmc_bytes(tokens))
    uris = {"one file": f"s3://{bucket}/{keys[0]}"}
    for count in (1, 10, 100):
        sub = f"{prefix}/s{count}"
        for i, part in enumerate(torch.tensor_split(torch.from_numpy(tokens), count)):
            key = f"{sub}/fineweb_train_{i + 1:06d}.bin"
            store.write(key, llmc_bytes(part.numpy()))
            keys.append(key)
        uris[f"{count} shard" + ("s" if count > 1 else "")] = (
            f"s3://{bucket}/{sub}/fineweb_train_*.bin")
    return uris, keys


def trial(uri: str, args: argparse.Namespace, endpoint: str, start: int) -> tuple[float, float]:
    """(seconds to open, samples/s of the reads) over one fresh dataset."""
    from elastrain_trainer.data import make_batch, micro_batch_indices
    from elastrain_trainer.tokenfiles import open_token_dataset

    global_batch = MICRO * ACCUM
    t0 = time.perf_counter()
    ds = open_token_dataset(uri, "llmc", seq_len=args.seq_len, seed=1, vocab_size=50304,
                            global_batch_size=global_batch, endpoint=endpoint)
    opened = time.perf_counter() - t0
    t0 = time.perf_counter()
    for step in range(args.samples // global_batch):
        for k in range(ACCUM):
            make_batch(ds, micro_batch_indices(start + step * global_batch, MICRO, 1, 0, k))
    rate = args.samples / (time.perf_counter() - t0)
    ds.close()
    return opened, rate


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32 << 20)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/token_shards.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with s3_target() as (endpoint, bucket):
        from elastrain_trainer.checkpoint.s3 import S3Storage

        uris, keys = upload(args, endpoint, bucket)
        opens: dict[str, list[float]] = {k: [] for k in LAYOUTS}
        rates: dict[str, list[float]] = {k: [] for k in LAYOUTS}
        try:
            for p in range(args.pairs):
                for layout in LAYOUTS:
                    o, r = trial(uris[layout], args, endpoint, start=p * 7919 * MICRO)
                    opens[layout].append(o)
                    rates[layout].append(r)
                    print(f"pair {p}: {layout:>10}: open {o:.3f} s, {r:,.0f} samples/s",
                          flush=True)
        finally:
            S3Storage(f"s3://{bucket}", endpoint_url=endpoint).delete(keys)
    result: dict[str, object] = {"layouts": {}}
    base_open = statistics.median(opens["one file"])
    base_rate = statistics.median(rates["one file"])
    for layout in LAYOUTS:
        o, r = statistics.median(opens[layout]), statistics.median(rates[layout])
        result["layouts"][layout] = {  # type: ignore[index]
            "open_s": o, "open_s_min_max": [min(opens[layout]), max(opens[layout])],
            "samples_per_s": r, "samples_per_s_min_max": [min(rates[layout]), max(rates[layout])],
            "open_ratio_vs_one_file": o / base_open, "rate_ratio_vs_one_file": r / base_rate}
        print(f"{layout:>10}: open {o:.3f} s [{min(opens[layout]):.3f}-{max(opens[layout]):.3f}] "
              f"= {o / base_open:.2f}x one file; {r:,.0f} samples/s "
              f"[{min(rates[layout]):,.0f}-{max(rates[layout]):,.0f}] = {r / base_rate:.2f}x")
    result.update(date=time.strftime("%Y-%m-%d"), args={k: str(v) for k, v in vars(args).items()},
                  machine={"cpus": os.cpu_count(), "platform": platform.platform(),
                           "torch": torch.__version__})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
