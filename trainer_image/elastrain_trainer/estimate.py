"""Per-rank memory of a config, the start-up check that refuses what cannot fit, what makes a
config fit a device (`plan_fit`), and the measured peak the estimate is checked against.

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
    ranks_per_node: int = 1  # HSDP's shard group

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


def estimate(config: TrainerConfig, world_size: int, device: str = "cuda",
             ranks_per_node: int = 1) -> MemoryEstimate:
    """Per-rank peak memory of `config` at `world_size` ranks on a `device` ("cpu", "cuda");
    HSDP shards over a pod's `ranks_per_node` ranks and replicates across pods."""
    if world_size < 1:
        raise ValueError("world size must be >= 1")
    if device not in RUNTIME_OVERHEAD_BYTES:
        raise ValueError(f"device {device!r} must be one of {', '.join(RUNTIME_OVERHEAD_BYTES)}")
    shape = dataclasses.replace(PRESETS[config.model], vocab_size=config.vocab_size)
    n = count_parameters(shape, config.seq_len)
    shard = {"fsdp": world_size, "hsdp": max(1, min(ranks_per_node, world_size))}.get(
        config.strategy, 1)
    params, grads, optim = 4 * n // shard, 4 * n // shard, 8 * n // shard
    if config.strategy == "ddp":
        buffers = 4 * n
    else:
        block = count_parameters(dataclasses.replace(shape, n_layer=1), 0) - _root_params(shape)
        buffers = 4 * (2 * block + _root_params(shape) + config.seq_len * shape.d_model)
    offloaded = 0
    # wrap_model offloads only where the compute device is not the host.
    if config.cpu_offload and config.strategy != "ddp" and device == "cuda":
        offloaded, params, grads, optim = params + grads + optim, 0, 0, 0
    return MemoryEstimate(model=config.model, strategy=config.strategy, world_size=world_size,
                          precision=config.precision, device=device, n_params=n,
                          params_bytes=params, grads_bytes=grads, optimizer_bytes=optim,
                          buffers_bytes=buffers, activations_bytes=_activations(config, shape),
                          overhead_bytes=RUNTIME_OVERHEAD_BYTES[device],
                          offloaded_bytes=offloaded, ranks_per_node=ranks_per_node)


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


# The knobs `plan_fit` tries, cheapest first, with how a TrainingJob spells them.
KNOB_SETTINGS = {"strategy": "spec.strategy", "activation_checkpointing":
                 "spec.trainer.activationCheckpointing", "micro_batch_size":
                 "spec.trainer.microBatchSize", "cpu_offload": "spec.trainer.cpuOffload"}
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "ki": 1 << 10, "kib": 1 << 10,
          "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40,
          "tib": 1 << 40}


@dataclass(frozen=True)
class Fix:
    """Config changes (TrainerConfig field -> value) and the estimate they give."""

    changes: dict[str, object]
    estimate: MemoryEstimate

    def describe(self) -> str:
        settings = ", ".join(f"{KNOB_SETTINGS[k]}: {_yaml(v)}" for k, v in self.changes.items())
        return f"{settings} -> {_gib(self.estimate.total_bytes)}"


@dataclass(frozen=True)
class FitPlan:
    """Whether a config fits a device, and if not, what makes it fit."""

    estimate: MemoryEstimate
    device_bytes: int
    fixes: list[Fix]  # empty when it fits as it is, or when nothing tried fits

    @property
    def fits(self) -> bool:
        return self.estimate.total_bytes <= self.device_bytes

    def format(self) -> str:
        need, have = _gib(self.estimate.total_bytes), _gib(self.device_bytes)
        if self.fits:
            return f"fits: {need} of {have} per rank"
        if not self.fixes:
            return (f"does not fit: {need} of {have} per rank, and no knob tried (fsdp, "
                    "activation checkpointing, micro-batch, cpu offload) makes it fit: use "
                    "more workers under fsdp, or a smaller model")
        return "\n".join([f"does not fit: {need} of {have} per rank; it fits with:"]
                         + [f"  {fix.describe()}" for fix in self.fixes])


def plan_fit(config: TrainerConfig, world_size: int, device_bytes: int,
             device: str = "cuda", ranks_per_node: int = 1) -> FitPlan:
    """Pure: does `config` fit `device_bytes` per rank at `world_size`? If not, each single knob
    that makes it fit (fsdp, activation checkpointing, the largest micro-batch that fits, cpu
    offload under fsdp); if no single one does, the first cumulative combination that does."""
    est = estimate(config, world_size, device, ranks_per_node)
    if est.total_bytes <= device_bytes:
        return FitPlan(est, device_bytes, [])
    singles = [c for c in _single_knobs(est, config, device_bytes) if c]
    fits = [f for f in (_try(config, est, c) for c in singles)
            if f.estimate.total_bytes <= device_bytes]
    if fits:
        return FitPlan(est, device_bytes, fits)
    combined: dict[str, object] = {}
    for change in _single_knobs(est, config, device_bytes, smallest_batch=True):
        combined.update(change)
        fix = _try(config, est, dict(combined))
        if fix.estimate.total_bytes <= device_bytes:
            return FitPlan(est, device_bytes, [fix])
    return FitPlan(est, device_bytes, [])


def _single_knobs(est: MemoryEstimate, config: TrainerConfig, device_bytes: int,
                  smallest_batch: bool = False) -> list[dict[str, object]]:
    """One change per knob, cheapest first; {} where the knob is already set or cannot apply."""
    fsdp: dict[str, object] = ({"strategy": "fsdp"} if config.strategy == "ddp"
                               and est.world_size > 1 else {})
    ckpt: dict[str, object] = ({} if config.activation_checkpointing
                               else {"activation_checkpointing": True})
    batches = _smaller_micro_batches(config, est.world_size)
    if not smallest_batch:
        # The largest micro-batch that fits keeps the most throughput.
        batches = [m for m in batches if _try(config, est, {"micro_batch_size": m})
                   .estimate.total_bytes <= device_bytes][:1]
    batch: dict[str, object] = {"micro_batch_size": batches[-1]} if batches else {}
    # Offloading only moves memory off a GPU (wrap_model offloads nothing on a CPU run).
    offload: dict[str, object] = (
        {} if config.cpu_offload or est.device != "cuda"
        else {"cpu_offload": True} if config.strategy == "fsdp"
        else {"strategy": "fsdp", "cpu_offload": True})
    return [fsdp, ckpt, batch, offload]


def _smaller_micro_batches(config: TrainerConfig, world_size: int) -> list[int]:
    """Micro-batches below the current one that keep the global batch at this world, largest
    first (global = micro x world x accumulation)."""
    if config.global_batch_size % world_size:
        return []
    per_rank = config.global_batch_size // world_size
    return [m for m in range(config.micro_batch_size - 1, 0, -1) if per_rank % m == 0]


def _try(config: TrainerConfig, est: MemoryEstimate, changes: dict[str, object]) -> Fix:
    changed = dataclasses.replace(config, **changes)  # type: ignore[arg-type]
    return Fix(changes, estimate(changed, est.world_size, est.device, est.ranks_per_node))


def parse_bytes(text: str) -> int:
    """'80GiB', '80Gi', '40G', '512MiB', '1e9' -> bytes (binary units for *i and *iB)."""
    number = text.strip().rstrip("bBiIkKmMgGtT ")
    unit = text.strip()[len(number):].strip().lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ValueError(f"{text!r} is not a memory size (e.g. 80GiB, 80Gi, 40GB, 512MiB)")
    return int(value * _UNITS[unit])


def _yaml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


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
