"""Checkpoint of a ~100M-parameter GPT (+ AdamW state) to S3/MinIO: sync vs async.

    .venv/bin/python bench/checkpoint_s3.py [--pairs 3]

Uses ELASTRAIN_S3_ENDPOINT / _ACCESS_KEY / _SECRET_KEY / _BUCKET when set, else starts
MinIO through hack/cluster.py. Interleaves sync and async saves (ABAB...) in one process
(a gloo world of one, torch.set_num_threads(1)) and prints medians with min-max of:
blocked (training loop stalled) and total (start to commit). The ceiling is one boto3
managed upload of the same number of bytes from memory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from s3_target import s3_target

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--model", default="gpt-100m")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with s3_target() as (endpoint, bucket):
        run(args, endpoint, bucket)
    return 0


def run(args: argparse.Namespace, endpoint: str, bucket: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest
    from elastrain_trainer.checkpoint.s3 import S3Storage
    from elastrain_trainer.model import build_model

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29655", rank=0, world_size=1)
    model = build_model(args.model, 128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # materialise exp_avg / exp_avg_sq
    n = sum(p.numel() for p in model.parameters())
    storage = S3Storage(f"s3://{bucket}/bench/{uuid.uuid4().hex[:8]}", endpoint_url=endpoint)
    payload = bytearray(12 * n)  # the bytes of fp32 params + two AdamW moments
    t0 = time.monotonic()
    storage.write("ceiling.bin", payload)
    ceiling = time.monotonic() - t0
    results: dict[str, list[tuple[float, float]]] = {"sync": [], "async": []}
    step = 0
    for _ in range(args.pairs):
        for mode in ("sync", "async"):
            step += 1
            manager = CheckpointManager(storage, keep=1, async_save=mode == "async")
            msd, osd = get_state_dict(model, opt)
            t0 = time.monotonic()
            blocked = manager.save(SaveRequest(step, {"model": msd, "optim": osd}, {}))
            assert manager.wait(), "save failed"
            results[mode].append((blocked, time.monotonic() - t0))
    gb = 12 * n / 1e9
    print(f"model {args.model}: {n / 1e6:.1f}M params; checkpoint ~{gb:.2f} GB "
          f"(fp32 params + 2 AdamW moments); pairs={args.pairs}")
    print(f"ceiling: one managed PUT of {gb:.2f} GB from memory: {ceiling:.2f} s "
          f"({gb / ceiling:.2f} GB/s)")
    for mode, rows in results.items():
        blocked = [b for b, _ in rows]
        total = [t for _, t in rows]
        print(f"{mode:>5}: blocked median {statistics.median(blocked):.3f} s "
              f"[{min(blocked):.3f}-{max(blocked):.3f}]  total median "
              f"{statistics.median(total):.2f} s [{min(total):.2f}-{max(total):.2f}]  "
              f"({gb / statistics.median(total):.2f} GB/s)")
    ratio = statistics.median(b for b, _ in results["sync"]) / statistics.median(
        b for b, _ in results["async"])
    print(f"blocking time sync/async: {ratio:.1f}x")
    storage.delete(storage.list())
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
