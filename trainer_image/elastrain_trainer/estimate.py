"""Per-rank memory of a config, the start-up check that refuses what cannot fit, and the
measured peak the estimate is checked against.

Per rank, at the step's peak:
- model states: fp32 params + two fp32 AdamW moments (autocast keeps fp32 master weights),
  divided by the world under FSDP;
- communication buffers: DDP's reducer keeps gradient buckets, a flat fp32 copy of every
  gradient (4 bytes/param on top of the gradients); FSDP holds the unsharded params of the block
  it computes and of the one it prefetches, and the root's (embeddings, head) through the step;
- gradients (fp32, sharded under FSDP) and activations do not peak together: activations are
  largest at the end of the forward, before any gradient exists (zero_grad sets them to None),
  and backward frees them as it creates gradients; the larger of the two counts;
- activations: per layer the block saves 17 tensors of s*b*d (x, ln_1 out, q, k, v, the
  attention output and its reshaped copy, x, ln_2 out, 4x fc out, 4x gelu out): 68 bytes per
  s*b*d at fp32, ~34 at 16 bit (Korthikanti et al. without dropout). No s*s attention term:
  scaled_dot_product_attention (flash / memory-efficient, and the CPU kernel) never keeps the
  scores. Activation checkpointing keeps each block's fp32 input plus one recomputed block.
  The logits add their log-softmax and gradient (3 x s*b*vocab fp32);
- runtime: on the host, the process itself (a gpt-tiny worker peaks at ~0.7 GiB resident:
  importing the CUDA build of torch alone is ~0.53 GiB); on a GPU, the CUDA context, NCCL and
  the caching allocator's slack, which torch.cuda.max_memory_allocated does not count.

Checked against real CPU runs in tests/integration/trainer/test_memory_estimate.py (within 20%
of the measured peak resident set for DDP, FSDP and FSDP with activation checkpointing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.presets import PRESETS, GPTShape, count_parameters

GIB = 1 << 30
# Per process, besides tensors. Host: measured (a gpt-tiny worker under torchrun: 714 MiB).
# CUDA: context, NCCL and allocator slack, loosely (not measured here: no GPU).
RUNTIME_OVERHEAD_BYTES = {"cpu": 3 * GIB // 4, "cuda": GIB // 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank; `total_bytes` is what must fit on the device."""

    model: str
    strategy: str
    world_size: int
    precision: str
    device: str  # "cpu" or "cuda": where the tensors live
    n_params: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    buffers_bytes: int  # DDP's gradient buckets; FSDP's unsharded blocks
    activations_bytes: int
    overhead_bytes: int
    offloaded_bytes: int

    @property
    def total_bytes(self) -> int:
        # Gradients and activations never peak together (see the module docstring).
        return (self.params_bytes + self.optimizer_bytes + self.buffers_bytes
                + max(self.grads_bytes, self.activations_bytes) + self.overhead_bytes)

    def format(self) -> str:
        grads_peak = self.grads_bytes >= self.activations_bytes
        rows = [("parameters", self.params_bytes, ""),
                ("gradients", self.grads_bytes, "" if grads_peak else " (not at the peak)"),
                ("optimizer (AdamW)", self.optimizer_bytes, ""),
                ("comm. buffers", self.buffers_bytes,
                 " (gradient buckets)" if self.strategy == "ddp" else " (unsharded blocks)"),
                ("activations", self.activations_bytes,
                 " (not at the peak)" if grads_peak else ""),
                ("runtime overhead", self.overhead_bytes, "")]
        lines = [f"{self.model}: {self.n_params / 1e6:.1f}M params, {self.strategy.upper()} x "
                 f"{self.world_size} rank(s), {self.precision} on {self.device}; per rank:"]
        lines += [f"  {name:<18} {_gib(n)}{note}" for name, n, note in rows]
        lines.append(f"  {'total (peak)':<18} {_gib(self.total_bytes)}")
        if self.offloaded_bytes:
            lines.append(f"  (+ {_gib(self.offloaded_bytes)} offloaded to host memory)")
        return "\n".join(lines)


def estimate(config: TrainerConfig, world_size: int, device: str = "cuda") -> MemoryEstimate:
    """Per-rank peak memory of `config` at `world_size` ranks on a `device` ("cpu", "cuda")."""
    if world_size < 1:
        raise ValueError("world size must be >= 1")
    if device not in RUNTIME_OVERHEAD_BYTES:
        raise ValueError(f"device {device!r} must be one of {', '.join(RUNTIME_OVERHEAD_BYTES)}")
    shape = dataclasses.replace(PRESETS[config.model], vocab_size=config.vocab_size)
    n = count_parameters(shape, config.seq_len)
    shard = world_size if config.strategy == "fsdp" else 1
    params, grads, optim = 4 * n // shard, 4 * n // shard, 8 * n // shard
    if config.strategy == "ddp":
        buffers = 4 * n
    else:
        block = count_parameters(dataclasses.replace(shape, n_layer=1), 0) - _root_params(shape)
        buffers = 4 * (2 * block + _root_params(shape) + config.seq_len * shape.d_model)
    offloaded = 0
    # wrap_model offloads only where the compute device is not the host.
    if config.cpu_offload and config.strategy == "fsdp" and device == "cuda":
        offloaded, params, grads, optim = params + grads + optim, 0, 0, 0
    return MemoryEstimate(model=config.model, strategy=config.strategy, world_size=world_size,
                          precision=config.precision, device=device, n_params=n,
                          params_bytes=params, grads_bytes=grads, optimizer_bytes=optim,
                          buffers_bytes=buffers, activations_bytes=_activations(config, shape),
                          overhead_bytes=RUNTIME_OVERHEAD_BYTES[device],
                          offloaded_bytes=offloaded)


def _activations(config: TrainerConfig, shape: GPTShape) -> int:
    """Bytes saved for backward by one micro-batch (see the module docstring)."""
    sbd = config.seq_len * config.micro_batch_size * shape.d_model
    per_layer = sbd * (68 if config.precision == "fp32" else 34)
    if config.activation_checkpointing:
        layers = shape.n_layer * 4 * sbd + per_layer  # fp32 block inputs + one recomputed block
    else:
        layers = shape.n_layer * per_layer
    logits = 3 * config.seq_len * config.micro_batch_size * shape.vocab_size * 4
    return layers + logits


def _root_params(shape: GPTShape) -> int:
    """Params outside the blocks but for the position table: token embedding, final norm, head."""
    return 2 * shape.vocab_size * shape.d_model + 2 * shape.d_model


def check_fits(est: MemoryEstimate, available_bytes: int, where: str) -> None:
    """ValueError with the estimate when it does not fit in `available_bytes`."""
    if est.total_bytes > available_bytes:
        raise ValueError(
            f"this config needs about {_gib(est.total_bytes)} per rank but {where} has "
            f"{_gib(available_bytes)} available; use a smaller ELASTRAIN_MODEL or "
            "ELASTRAIN_MICRO_BATCH_SIZE, ELASTRAIN_STRATEGY=fsdp with more workers, or "
            "ELASTRAIN_ACTIVATION_CHECKPOINTING=1\n" + est.format())


def available_host_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable of this machine (what a new allocation can get without swapping)."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no MemAvailable in {meminfo}")


M_MMAP_THRESHOLD = -3  # glibc's mallopt() parameter number
HOST_MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own initial value, kept fixed


def return_freed_host_memory(env: Mapping[str, str] = os.environ) -> bool:
    """Have glibc map every block over 128 KiB on its own, so freeing a tensor gives its memory
    back to the OS; True when set. Call it before a CPU run allocates its model.

    By default glibc raises this threshold to the size of each mapped block freed (up to 32 MiB),
    and blocks under it then come from the heap, which keeps freed memory: a gpt-100m FSDP worker
    on CPU (2 ranks) peaked at 2.62 GiB resident with 1.68 GiB of live tensors and runtime, and
    its estimate was 35% short. A process started with MALLOC_MMAP_THRESHOLD_ keeps that choice.
    """
    if "MALLOC_MMAP_THRESHOLD_" in env:
        return False
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD_BYTES))


def measure_peak(device_type: str, status: str = "/proc/self/status") -> tuple[int, str]:
    """(bytes, measure): this process's peak so far, what `estimate` predicts per rank.

    On CUDA, torch's max allocated (the CUDA context and the caching allocator's slack are the
    estimate's overhead). On the host, VmHWM, the peak resident set of this process's address
    space. Not getrusage's ru_maxrss: Linux keeps that across execve, so a worker exec'd by
    torchrun would report the agent's own peak if it was larger.
    """
    if device_type == "cuda":
        import torch  # only here: the estimate itself stays importable without torch

        return int(torch.cuda.max_memory_allocated()), "cuda_allocated"
    with open(status) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024, "host_rss"
    raise RuntimeError(f"no VmHWM in {status}")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
