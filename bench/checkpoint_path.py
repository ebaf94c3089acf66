"""Checkpoint save and load (resume) on S3: elastrain vs stock DCP over s3fs vs the boto3 ceiling.

    .venv/bin/python bench/checkpoint_path.py [--models gpt-100m,gpt-350m] [--rounds 3]
        [--b-threads 8] [--steps 6] [--out bench/results/checkpoint_path.json]

For each model, the state of a GPT + AdamW (fp32 params and two moments) in one process (a gloo
world of one, torch.set_num_threads(1)), against a MinIO of its own with its data on disk.
Each round runs, in this order, a save and then a load of:
  A   elastrain: CheckpointManager.save (sync), then a new manager's load() as resume does;
  B1  stock DCP: FsspecWriter/FsspecReader over s3fs, default settings;
  Bn  the same with thread_count=n (--b-threads);
  C   the ceiling: one boto3 managed multipart upload, then download into preallocated memory,
      of as many bytes as A's checkpoint (elastrain's TransferConfig and client).
Every load is checked: the state is zeroed first and compared with the saved values after.
As context, each round also times sha256 over C's bytes alone (what verifying costs here).
Prints medians with min-max of each, and the ratios measured side by side: A/C as % of the
ceiling (time C / time A) and B/A (time B / time A, > 1: elastrain is faster).

Then the async path, per model: `--steps` training steps (batch 1, seq 128) with no upload,
then an async save and the steps that run while it is in flight, per round; prints the stall
(time the caller was blocked / median sync save time of A) and the in-flight step slowdown
(median step time while uploading / median step time without).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from s3_target import s3_target

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt-100m,gpt-350m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--b-threads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--variants", default="A,B1,Bn,C")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint_path.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0,
                            world_size=1)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results: dict[str, Any] = {"started": started, "machine": _machine(), "args": vars(args),
                               "models": {}}
    with s3_target(disk=True) as (endpoint, bucket):
        for model in args.models.split(","):
            results["models"][model] = bench_model(args, model, endpoint, bucket)
    dist.destroy_process_group()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _port() -> int:
    from elastrain_trainer.ports import free_port

    return free_port()


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_before": os.getloadavg()}


class Bench:
    """One model's state and the four ways to save and load it."""

    def __init__(self, model_name: str, endpoint: str, bucket: str) -> None:
        import boto3

        from elastrain_trainer.checkpoint.s3 import CLIENT_CONFIG
        from elastrain_trainer.model import build_model

        self.endpoint, self.bucket = endpoint, bucket
        self.model = build_model(model_name, 128)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        for p in self.model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        self.opt.step()  # materialise exp_avg / exp_avg_sq
        self.model.zero_grad(set_to_none=True)
        self.client = boto3.client("s3", endpoint_url=endpoint, config=CLIENT_CONFIG)
        self.ckpt_bytes = 0
        self.step = 0

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def tensors(self) -> list[torch.Tensor]:
        out = [p.data for p in self.model.parameters()]
        for s in self.opt.state.values():
            out.extend(v for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return out

    def fingerprint(self) -> list[float]:
        return [float(t.double().sum()) for t in self.tensors()[:3] + self.tensors()[-3:]]

    def zero(self) -> None:
        for t in self.tensors():
            t.zero_()

    def prefix(self) -> str:
        return f"bench-path/{uuid.uuid4().hex[:8]}"

    def delete(self, prefix: str) -> None:
        keys = [o["Key"] for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix + "/") for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})

    # -- A: elastrain -----------------------------------------------------------------------
    def a(self, prefix: str) -> tuple[Callable[[], None], Callable[[], None]]:
        from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest
        from elastrain_trainer.checkpoint.s3 import S3Storage

        storage = S3Storage(f"s3://{self.bucket}/{prefix}", endpoint_url=self.endpoint)
        self.step += 1
        step = self.step

        def save() -> None:
            manager = CheckpointManager(storage, keep=1, async_save=False)
            manager.save(SaveRequest(step, self.state(), {}))
            assert manager.last_committed is not None and manager.last_committed.step == step, \
                f"save failed: {manager.last_error}"

        def load() -> None:
            result = CheckpointManager(storage, keep=1, async_save=False).load(self.state())
            assert result is not None and result.step == step, "load found no checkpoint"
        return save, load

    # -- B: stock DCP over s3fs -------------------------------------------------------------
    def b(self, prefix: str, threads: int) -> tuple[Callable[[], None], Callable[[], None]]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter

        url = f"s3://{self.bucket}/{prefix}"

        def save() -> None:
            dcp.save(self.state(), storage_writer=FsspecWriter(
                url, thread_count=threads, endpoint_url=self.endpoint))

        def load() -> None:
            dcp.load(self.state(), storage_reader=FsspecReader(url, endpoint_url=self.endpoint))
        return save, load

    # -- C: the ceiling ---------------------------------------------------------------------
    def c(self, prefix: str, payload: bytearray) -> tuple[Callable[[], None], Callable[[], None]]:
        from elastrain_trainer.checkpoint.s3 import TRANSFER, _MemoryReader, _MemoryWriter

        key = f"{prefix}/ceiling.bin"
        into = bytearray(len(payload))

        def save() -> None:
            self.client.upload_fileobj(_MemoryReader(payload), self.bucket, key, Config=TRANSFER)

        def load() -> None:
            self.client.download_fileobj(self.bucket, key, _MemoryWriter(into), Config=TRANSFER)
            assert into[:4096] == payload[:4096] and into[-4096:] == payload[-4096:]
        return save, load

    def checkpoint_size(self, prefix: str) -> int:
        return sum(o["Size"] for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix + "/") for o in page.get("Contents", [])
            if o["Key"].endswith(".distcp"))


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_model(args: argparse.Namespace, model_name: str, endpoint: str,
                bucket: str) -> dict[str, Any]:
    bench = Bench(model_name, endpoint, bucket)
    n = sum(p.numel() for p in bench.model.parameters())
    print(f"\n== {model_name}: {n / 1e6:.1f}M params, fp32 params + 2 AdamW moments", flush=True)
    reference = bench.fingerprint()
    payload: bytearray | None = None
    variants = args.variants.split(",")
    times: dict[str, dict[str, list[float]]] = {v: {"save": [], "load": []} for v in variants}
    hashes: list[float] = []
    for r in range(args.rounds):
        for variant in variants:
            prefix = bench.prefix()
            if variant == "C":
                if payload is None:
                    payload = _payload(bench.ckpt_bytes or 12 * n)
                save, load = bench.c(prefix, payload)
            elif variant == "A":
                save, load = bench.a(prefix)
            else:
                save, load = bench.b(prefix, 1 if variant == "B1" else args.b_threads)
            t_save = timed(save)
            if variant == "A" and not bench.ckpt_bytes:
                bench.ckpt_bytes = bench.checkpoint_size(prefix)
            if variant != "C":
                bench.zero()
            t_load = timed(load)
            if variant != "C":
                assert bench.fingerprint() == reference, f"{variant} loaded other values"
            bench.delete(prefix)
            if variant == "C":  # context: what verifying every byte costs here, alone
                hashes.append(timed(lambda: _sha256(payload)))  # noqa: B023
            times[variant]["save"].append(t_save)
            times[variant]["load"].append(t_load)
            print(f"round {r + 1} {variant:>3}: save {t_save:7.2f} s  load {t_load:7.2f} s",
                  flush=True)
            time.sleep(1)  # let MinIO's trash cleanup start on what was just deleted
    gb = bench.ckpt_bytes / 1e9
    out: dict[str, Any] = {"params": n, "checkpoint_bytes": bench.ckpt_bytes, "times_s": times,
                           "sha256_alone_s": hashes}
    print(f"{model_name}: checkpoint {gb:.2f} GB; medians over {args.rounds} rounds "
          f"[min-max]:")
    for v, t in times.items():
        print(f"  {v:>3}: save {_fmt(t['save'])} ({gb / statistics.median(t['save']):.2f} GB/s)"
              f"  load {_fmt(t['load'])} ({gb / statistics.median(t['load']):.2f} GB/s)")
    if hashes:
        print(f"  sha256 of the same bytes alone: {_fmt(hashes)}")
    out["ratios"] = _ratios(times)
    for name, value in out["ratios"].items():
        print(f"  {name}: {value}")
    payload = None  # the async part keeps a staged copy of the state instead
    if "A" in times:
        out["async"] = bench_async(args, bench, statistics.median(times["A"]["save"]))
    del bench
    return out


def _ratios(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per-round ratios (same round = side by side), as median [min, max]."""
    out: dict[str, Any] = {}

    def ratio(name: str, num: str, den: str, op: str) -> None:
        if num in times and den in times:
            rs = [n / d for n, d in zip(times[num][op], times[den][op], strict=True)]
            out[name] = {"median": round(statistics.median(rs), 3),
                         "min": round(min(rs), 3), "max": round(max(rs), 3)}

    for op in ("save", "load"):
        ratio(f"A/C {op} (fraction of ceiling = tC/tA)", "C", "A", op)
        ratio(f"B1/A {op} (tB1/tA)", "B1", "A", op)
        ratio(f"Bn/A {op} (tBn/tA)", "Bn", "A", op)
    return out


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} s [{min(xs):.2f}-{max(xs):.2f}]"


def _sha256(data: bytearray | None) -> None:
    assert data is not None
    hashlib.sha256(data).hexdigest()


def _payload(size: int) -> bytearray:
    block = os.urandom(64 * MIB)
    out = bytearray(size)
    for i in range(0, size, len(block)):
        out[i:i + len(block)] = block[:size - i]
    return out


def bench_async(args: argparse.Namespace, bench: Bench, sync_save_s: float) -> dict[str, Any]:
    """Stall of an async save and the slowdown of the steps that run while it uploads."""
    from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest
    from elastrain_trainer.checkpoint.s3 import S3Storage
    from elastrain_trainer.model import lm_loss

    prefix = bench.prefix()
    storage = S3Storage(f"s3://{bench.bucket}/{prefix}", endpoint_url=bench.endpoint)
    manager = CheckpointManager(storage, keep=1, async_save=True)
    x = torch.randint(0, 256, (1, 128))

    def train_step() -> float:
        t0 = time.perf_counter()
        lm_loss(bench.model(x), x).backward()
        bench.opt.step()
        bench.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    quiet: list[float] = []
    busy: list[float] = []
    stalls: list[float] = []
    uploads: list[float] = []
    train_step()  # warm-up
    for _ in range(args.rounds):
        quiet.extend(train_step() for _ in range(args.steps))
        bench.step += 1
        t0 = time.perf_counter()
        stalls.append(manager.save(SaveRequest(bench.step, bench.state(), {})))
        while manager.in_flight():
            busy.append(train_step())
        uploads.append(time.perf_counter() - t0)
        assert manager.wait(), f"async save failed: {manager.last_error}"
        assert manager.last_committed is not None and manager.last_committed.step == bench.step
    manager.close()
    bench.delete(prefix)
    stall = statistics.median(stalls)
    slowdown = statistics.median(busy) / statistics.median(quiet) - 1 if busy else 0.0
    print(f"  async: blocked {_fmt(stalls)}; stall/sync save = {stall / sync_save_s:.3f}; "
          f"save to commit {_fmt(uploads)}; steps while uploading {len(busy)} "
          f"median {statistics.median(busy) if busy else 0:.3f} s vs "
          f"{statistics.median(quiet):.3f} s without: slowdown {100 * slowdown:.1f}%", flush=True)
    return {"blocked_s": stalls, "save_to_commit_s": uploads, "step_s_quiet": quiet,
            "step_s_in_flight": busy, "stall_over_sync_save": round(stall / sync_save_s, 4),
            "in_flight_step_slowdown": round(slowdown, 4)}


if __name__ == "__main__":
    sys.exit(main())
