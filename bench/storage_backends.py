"""s3:// checkpoint storage: boto3 (S3Storage) vs fsspec over s3fs (FsspecStorage), same MinIO.

    .venv/bin/python bench/storage_backends.py [--pairs 5] [--shard-mib 64] [--shards 4]
        [--out bench/results/storage_backends.json]

One checkpoint-shaped write (N shards from memory, then 20 small objects: digests, manifest,
sidecar, marker, latest) and the read of it back, through each backend in turn (ABAB...) in
one process. Prints medians with min-max and the fsspec/boto3 ratio (> 1: fsspec is slower).
Uses ELASTRAIN_S3_ENDPOINT / _ACCESS_KEY / _SECRET_KEY / _BUCKET when set, else starts MinIO
through hack/cluster.py (as checkpoint_s3.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import uuid
from pathlib import Path

from s3_target import s3_target

from elastrain_trainer.checkpoint.fsspec_storage import FsspecStorage
from elastrain_trainer.checkpoint.s3 import S3Storage
from elastrain_trainer.checkpoint.storage import CheckpointStorage

MIB = 1 << 20


def one_round(storage: CheckpointStorage, shards: list[memoryview]) -> tuple[float, float]:
    """Seconds to write a checkpoint's objects, then to read them all back."""
    t0 = time.perf_counter()
    for i, shard in enumerate(shards):
        storage.write(f"step-1/__{i}_0.distcp", shard)
    for i in range(20):
        storage.write(f"step-1/small-{i}.json", b"{}" * 64)
    t1 = time.perf_counter()
    total = sum(len(storage.read(k)) for k in storage.list("step-1/"))
    t2 = time.perf_counter()
    assert total == sum(s.nbytes for s in shards) + 20 * 128
    storage.delete(storage.list())
    return t1 - t0, t2 - t1


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.3f} s (min {min(xs):.3f}, max {max(xs):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results"
                        / "storage_backends.json")
    args = parser.parse_args()
    with s3_target() as (endpoint, bucket):
        result = run(args, endpoint, bucket)
    result.update(date=time.strftime("%Y-%m-%d"), args={k: str(v) for k, v in vars(args).items()},
                  machine={"cpus": os.cpu_count(), "platform": platform.platform()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def run(args: argparse.Namespace, endpoint: str, bucket: str) -> dict[str, object]:
    root = f"s3://{bucket}/bench-backends-{uuid.uuid4().hex[:8]}"
    backends: dict[str, CheckpointStorage] = {
        "boto3": S3Storage(root + "/boto3", endpoint_url=endpoint),
        "fsspec": FsspecStorage(root + "/fsspec", endpoint),
    }
    shards = [memoryview(os.urandom(args.shard_mib * MIB)) for _ in range(args.shards)]
    for storage in backends.values():
        one_round(storage, shards)  # warm-up: connections, credentials, imports
    writes: dict[str, list[float]] = {name: [] for name in backends}
    reads: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(args.pairs):
        for name, storage in backends.items():
            w, r = one_round(storage, shards)
            writes[name].append(w)
            reads[name].append(r)
    size = args.shards * args.shard_mib
    result: dict[str, object] = {"mib": size, "write_s": writes, "read_s": reads}
    print(f"{args.shards} x {args.shard_mib} MiB shards + 20 small objects, {args.pairs} pairs "
          f"(ABAB), endpoint {endpoint}")
    for what, table in (("write", writes), ("read", reads)):
        for name, xs in table.items():
            print(f"  {what:5} {name:6} {summary(xs)}  {size / statistics.median(xs):7.1f} MiB/s")
        ratios = [f / b for f, b in zip(table["fsspec"], table["boto3"], strict=True)]
        print(f"  {what:5} fsspec/boto3 ratio: median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
        result[f"{what}_fsspec_over_boto3"] = statistics.median(ratios)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
