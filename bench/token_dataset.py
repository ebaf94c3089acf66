"""Token file reads as the trainer does them: samples/s from MinIO vs from a local file.

    .venv/bin/python bench/token_dataset.py [--pairs 5] [--samples 8192] [--seq-len 1024]
        [--model gpt-100m] [--model-steps 3] [--out bench/results/token_dataset.json]

Uses ELASTRAIN_S3_ENDPOINT / _ACCESS_KEY / _SECRET_KEY / _BUCKET when set, else starts MinIO
through hack/cluster.py. Writes one llm.c v1 file (uint16 tokens) to a temp dir and to the
bucket, then in one process interleaves (file, s3, s3 without read-ahead, ...) trials; each
trial opens a fresh dataset (an empty sample cache) and reads `--samples` samples starting at a
new global index through data.make_batch (micro-batches of 8 of one rank at world size 1),
timing only the reads. The "+ compute" trials sleep --compute-ms after each step, as a model
step would, which is when read-ahead can hide the network. Prints medians with min-max and
the ratios. Ceilings, in the same run: one GET of the whole
object and one read of the whole file, expressed in samples/s. The local file sits in the page
cache (just written): "file" is the memory-map path, not a disk.

What the data path must keep up with, in the same run: --model-steps forward+backward passes
of --model (micro-batch 1 at --seq-len, all cores) give the samples/s this machine trains at;
the ratio data/compute says how far the data path is from being the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from s3_target import s3_target  # noqa: E402

from tests.token_files import llmc_bytes, pattern_tokens  # noqa: E402

MICRO = 8


def trial(uri: str, args: argparse.Namespace, endpoint: str, start: int,
          prefetch_steps: int, compute_s: float = 0.0) -> tuple[float, int, float]:
    """(samples/s of the time spent reading, samples the loop had to wait for, seconds to open:
    header, size and the vocabulary probe) over one fresh dataset; `compute_s` is slept after
    each step (a model step, GIL released)."""
    from elastrain_trainer.data import make_batch, micro_batch_indices
    from elastrain_trainer.tokenfiles import open_token_dataset

    global_batch = MICRO * args.accum
    opened = time.perf_counter()
    ds = open_token_dataset(uri, "llmc", seq_len=args.seq_len, seed=1, vocab_size=50304,
                            global_batch_size=global_batch, endpoint=endpoint,
                            prefetch_steps=prefetch_steps)
    opened = time.perf_counter() - opened
    reading = 0.0
    for step in range(args.samples // global_batch):
        t0 = time.perf_counter()
        for k in range(args.accum):
            x, _ = make_batch(ds, micro_batch_indices(start + step * global_batch, MICRO, 1, 0, k))
            assert x.shape == (MICRO, args.seq_len)
        reading += time.perf_counter() - t0
        time.sleep(compute_s)
    rate = args.samples / reading
    ds.close()
    return rate, ds.waits, opened


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16 << 20)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--model", default="gpt-100m")
    parser.add_argument("--model-steps", type=int, default=3, help="0: skip the model")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/token_dataset.json")
    args = parser.parse_args()
    model_rate = model_samples_per_s(args) if args.model_steps else None
    torch.set_num_threads(1)
    with s3_target() as (endpoint, bucket):
        result = run(args, endpoint, bucket)
    result["model"] = {"name": args.model, "seq_len": args.seq_len, "steps": args.model_steps,
                       "samples_per_s": model_rate}
    if model_rate:
        for where in ("file", "s3"):
            ratio = result["samples_per_s"][where] / model_rate
            result[f"{where}_over_model"] = ratio
            print(f"{where} data path / {args.model} training: {ratio:,.0f}x the samples/s it "
                  f"trains at ({model_rate:.2f} samples/s, micro-batch 1, seq {args.seq_len})")
    result.update(date=time.strftime("%Y-%m-%d"), args={k: str(v) for k, v in vars(args).items()},
                  machine={"cpus": os.cpu_count(), "platform": platform.platform(),
                           "torch": torch.__version__})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def model_samples_per_s(args: argparse.Namespace) -> float:
    """Samples/s of forward+backward of the model on this machine (one warm-up pass first)."""
    from elastrain_trainer.model import build_model, lm_loss

    model = build_model(args.model, args.seq_len, 50304)
    x = torch.randint(0, 50304, (1, args.seq_len + 1))
    times = []
    for i in range(args.model_steps + 1):
        t0 = time.perf_counter()
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        if i:
            times.append(time.perf_counter() - t0)
    del model
    return 1 / statistics.median(times)


def run(args: argparse.Namespace, endpoint: str, bucket: str) -> dict[str, object]:
    from elastrain_trainer.checkpoint.s3 import S3Storage

    data = llmc_bytes(pattern_tokens(args.tokens, 50304))
    path = Path(tempfile.mkdtemp()) / "train.bin"
    path.write_bytes(data)
    store = S3Storage(f"s3://{bucket}/bench-data/{uuid.uuid4().hex[:8]}", endpoint_url=endpoint)
    store.write("train.bin", data)
    uris = {"file": f"file://{path}", "s3": f"{store.uri}/train.bin"}
    window = (args.seq_len + 1) * 2
    t0 = time.perf_counter()
    store.read("train.bin")
    get_ceiling = len(data) / window / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    path.read_bytes()
    file_ceiling = len(data) / window / (time.perf_counter() - t0)

    compute = args.compute_ms / 1000
    modes: dict[str, tuple[str, int, float]] = {
        "file": ("file", 2, 0.0), "s3": ("s3", 2, 0.0), "s3, no read-ahead": ("s3", 0, 0.0),
        "s3 + compute": ("s3", 2, compute), "s3 + compute, no read-ahead": ("s3", 0, compute)}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    waits: dict[str, list[int]] = {m: [] for m in modes}
    opens: dict[str, list[float]] = {"file": [], "s3": []}
    windows = args.tokens // (args.seq_len + 1)
    steps = args.samples // (MICRO * args.accum)
    start = 0
    for _ in range(args.pairs):
        for mode, (where, ahead, compute_s) in modes.items():
            start = (start + args.samples) % max(1, windows - args.samples)
            rate, waited, opened = trial(uris[where], args, endpoint, start, ahead, compute_s)
            opens[where].append(opened)
            rates[mode].append(rate)
            waits[mode].append(waited)
    print(f"llm.c v1 file: {len(data) / 2**20:.0f} MiB, {windows} samples of seq_len "
          f"{args.seq_len} ({window} B each); {args.samples} samples per trial, micro-batch "
          f"{MICRO} x accum {args.accum}; pairs={args.pairs}")
    print(f"ceilings: one GET of the object {get_ceiling:,.0f} samples/s; one read of the file "
          f"{file_ceiling:,.0f} samples/s")
    med: dict[str, float] = {}
    for mode, rows in rates.items():
        med[mode] = statistics.median(rows)
        print(f"{mode:>27}: median {med[mode]:,.0f} samples/s [{min(rows):,.0f}-{max(rows):,.0f}]"
              f"  ({med[mode] * window / 1e6:.1f} MB/s; waited for "
              f"{statistics.median(waits[mode]):.0f} of {args.samples} samples)")
    print(f"file/s3: {med['file'] / med['s3']:.1f}x;  s3 read-ahead/none: "
          f"{med['s3'] / med['s3, no read-ahead']:.2f}x;  s3 = "
          f"{100 * med['s3'] / get_ceiling:.1f}% of the one-GET ceiling")
    print("open (header, size, vocabulary probe of <= 16 MiB): median "
          + ", ".join(f"{w} {statistics.median(v) * 1000:.0f} ms" for w, v in opens.items()))
    print(f"with {args.compute_ms:g} ms of compute per step, read time per step: read-ahead "
          f"{args.samples / med['s3 + compute'] / steps * 1000:.2f} ms, none "
          f"{args.samples / med['s3 + compute, no read-ahead'] / steps * 1000:.2f} ms")
    store.delete(store.list())
    return {"samples_per_s": med, "ceilings": {"get": get_ceiling, "file": file_ceiling},
            "waits": {m: statistics.median(w) for m, w in waits.items()},
            "open_ms": {w: statistics.median(v) * 1000 for w, v in opens.items()}}


if __name__ == "__main__":
    sys.exit(main())
