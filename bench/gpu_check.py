"""The GPU check of issue 35 item 4: one short script for a lent GPU machine (its own image:
no network, no MinIO, its own torch). Prints one JSON line per figure, each with the torch and
CUDA versions it ran on, and a summary table at the end.

    python bench/gpu_check.py                     # on the GPU: all three parts, ~5-8 min
    python bench/gpu_check.py --smoke             # here, on CPU: the same code paths, tiny

(a) MFU: the built-in GPT (a named preset, sequence length, micro batch, bf16 autocast, fused
    AdamW, torch.compile on or off) against the datasheet's dense bf16 rate and a bf16 matmul
    rate measured in the same run. FLOPs per token: 6 N + 12 L d T (N: parameters without the
    position embedding; the attention term as in nanoGPT's and PaLM's estimates).
(b) In-process regroup on NCCL at world size 1: the product's Generation forms a generation
    (cpu:gloo,cuda:nccl bound to the device), a DDP step runs on it, its NCCL groups are
    aborted, released and a new generation formed on the same device; the model and the
    optimizer state must be the same tensors with the same values after it. A single GPU
    cannot host two NCCL ranks: the release of a collective pending on a lost peer stays
    unverified (docs/recovery.md section 4).
(c) The blocked time of a checkpoint save from GPU memory to local disk, by the product's
    CheckpointManager (async: blocked while staged to host memory), then the commit's wait.

What the machine's torch lacks is reported per part and, where a part can go on without it,
bypassed here only (never in the product): each such bypass is printed as `bypass`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))

from elastrain_trainer.model import build_model, lm_loss
from elastrain_trainer.presets import PRESETS

# Dense bf16 tensor-core rate of an H100 SXM / H200 (NVIDIA datasheets; "with sparsity" is 2x).
DATASHEET_TFLOPS = {"H100": 989.4, "H200": 989.4}
RESULTS: list[dict[str, Any]] = []


def versions() -> dict[str, Any]:
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def report(part: str, **fields: Any) -> None:
    record = {"part": part, **fields, **versions()}
    RESULTS.append(record)
    print(json.dumps(record, default=str), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n ** 3 * repeats / (time.perf_counter() - t0) / 1e12


def flops_per_token(model: torch.nn.Module, preset: str, seq_len: int) -> float:
    shape = PRESETS[preset]
    n = sum(p.numel() for p in model.parameters()) - seq_len * shape.d_model  # without wpe
    return 6 * n + 12 * shape.n_layer * shape.d_model * seq_len


def part_mfu(args: argparse.Namespace, device: torch.device) -> None:
    peak_measured = matmul_tflops(device, args.matmul_n, args.matmul_repeats)
    report("matmul", tflops_bf16=round(peak_measured, 1), n=args.matmul_n)
    model = build_model(args.preset, args.seq_len, args.vocab).to(device)
    fpt = flops_per_token(model, args.preset, args.seq_len)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    step_model: Any = model
    compiled = args.compile
    if compiled:
        try:
            step_model = torch.compile(model)
        except Exception as e:  # reported, then measured uncompiled
            report("bypass", what="torch.compile", error=str(e)[:300])
            compiled = False
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), device=device)
    inputs, targets = x[:, :-1], x[:, 1:]

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(step_model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync(device)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    elapsed = time.perf_counter() - t0
    tokens_s = args.batch * args.seq_len * args.steps / elapsed
    achieved = tokens_s * fpt / 1e12
    name = torch.cuda.get_device_name() if device.type == "cuda" else ""
    datasheet = next((v for k, v in DATASHEET_TFLOPS.items() if k in name), None)
    report("mfu", preset=args.preset, seq_len=args.seq_len, micro_batch=args.batch,
           vocab=args.vocab, compile=compiled, precision="bf16 autocast, fp32 master",
           steps=args.steps, warmup_s=round(warmup_s, 1), tokens_per_s=round(tokens_s),
           model_tflops=round(achieved, 1),
           mfu_datasheet=None if datasheet is None else round(achieved / datasheet, 4),
           mfu_measured_matmul=round(achieved / peak_measured, 4),
           max_memory_gib=(round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
                           if device.type == "cuda" else None))


def state_sums(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[int], float]:
    ptrs = [p.data_ptr() for p in model.parameters()]
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    for s in opt.state.values():
        total += sum(float(v.double().sum()) for v in s.values() if torch.is_tensor(v))
    return ptrs, total


def part_regroup(args: argparse.Namespace, device: torch.device) -> None:
    import torch.distributed as dist
    from torch.distributed import HashStore  # type: ignore[attr-defined]
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastrain_trainer.inprocess import nccl, rewrap
    from elastrain_trainer.inprocess.generation import Generation

    if device.type == "cuda":
        report("regroup_env", async_error_handling=nccl.prepare_error_handling(os.environ))
        torch.cuda.set_device(device)
    try:
        rewrap.check_supported()
        wrap = rewrap.rewrap_ddp
    except ValueError as e:  # another torch's DDP: the product refuses; a plain re-wrap here
        report("bypass", what="rewrap.check_supported", error=str(e)[:300])
        wrap = None
    gen = Generation("gpu-check", lambda *a: None, device if device.type == "cuda" else None)
    store = HashStore()
    timeout = timedelta(seconds=60)
    t0 = time.perf_counter()
    gen.form(1, ("gpu-check",), dist.PrefixStore("gen/1/pg/", store), 0, 1, timeout)
    first_form_s = time.perf_counter() - t0
    model = build_model(args.regroup_preset, args.seq_len, args.vocab).to(device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, args.vocab, (2, args.seq_len + 1), device=device)

    def step(m: torch.nn.Module) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            lm_loss(m(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(ddp)
    sync(device)
    before = state_sums(model, opt)
    backend = dist.get_backend()
    t0 = time.perf_counter()
    gen.abort(1)
    abort_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gen.release(ddp)
    release_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gen.form(2, ("gpu-check",), dist.PrefixStore("gen/2/pg/", store), 0, 1, timeout)
    form_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ddp = wrap(ddp) if wrap is not None else DDP(model, device_ids=ids)
    rewrap_s = time.perf_counter() - t0
    after = state_sums(model, opt)
    step(ddp)
    sync(device)
    report("regroup", world_size=1, backend=backend, first_form_s=round(first_form_s, 3),
           abort_s=round(abort_s, 4), release_s=round(release_s, 4), form_s=round(form_s, 3),
           rewrap_s=round(rewrap_s, 4), same_tensors=before[0] == after[0],
           same_values=before[1] == after[1], trained_after=True,
           model_on=str(next(model.parameters()).device))
    gen.release(ddp)


def part_checkpoint(args: argparse.Namespace, device: torch.device) -> None:
    from elastrain_trainer.checkpoint.backends import open_storage
    from elastrain_trainer.checkpoint.manager import CheckpointManager, SaveRequest

    model = build_model(args.ckpt_preset, args.seq_len, args.vocab).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, args.vocab, (1, args.seq_len + 1), device=device)
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    sync(device)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with tempfile.TemporaryDirectory(dir=args.ckpt_dir) as root:
        manager = CheckpointManager(open_storage(f"file://{root}"), async_save=True)
        for step in (1, 2):  # the second save reuses the stager's host buffers
            t0 = time.perf_counter()
            blocked = manager.save(SaveRequest(step, state))
            committed = manager.wait()
            report("checkpoint", save=step, preset=args.ckpt_preset,
                   model_gib=round(size / 2**30, 2), blocked_s=round(blocked, 3),
                   until_committed_s=round(time.perf_counter() - t0, 3), committed=committed,
                   target="local disk " + root)
        manager.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny, on CPU (here)")
    parser.add_argument("--parts", default="mfu,regroup,checkpoint")
    parser.add_argument("--preset", default="gpt-1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--matmul-repeats", type=int, default=50)
    parser.add_argument("--regroup-preset", default="gpt-100m")
    parser.add_argument("--ckpt-preset", default="gpt-1b")
    parser.add_argument("--ckpt-dir", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.preset = args.regroup_preset = args.ckpt_preset = "gpt-tiny"
        args.seq_len, args.batch, args.vocab, args.steps, args.warmup = 64, 2, 256, 3, 1
        args.matmul_n, args.matmul_repeats, args.compile = 256, 3, False
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.smoke \
        else torch.device("cpu")
    report("start", parts=args.parts, smoke=args.smoke)
    failed = []
    for part in args.parts.split(","):
        fn = {"mfu": part_mfu, "regroup": part_regroup, "checkpoint": part_checkpoint}[part]
        t0 = time.perf_counter()
        try:
            fn(args, device)
        except Exception as e:  # one part's failure must not hide the others
            failed.append(part)
            report("failed", which=part, error=f"{type(e).__name__}: {e}"[:500],
                   trace=traceback.format_exc()[-1500:])
        with contextlib.suppress(Exception):
            report("part_time", which=part, seconds=round(time.perf_counter() - t0, 1))
    print("\n".join(f"{r['part']:>12}  " + ", ".join(f"{k}={v}" for k, v in r.items()
                                                      if k not in ("part", "trace"))
                    for r in RESULTS))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
