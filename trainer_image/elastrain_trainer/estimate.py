"""Per-rank memory estimate of a config, and the startup check that refuses what cannot fit.

Model states follow the usual accounting: fp32 params + fp32 grads + two fp32 AdamW
moments (autocast keeps fp32 master weights), divided by the world under FSDP. Activations
follow Korthikanti et al. (per layer ~ s*b*d*(34 + 5*a*s/d) bytes at 16 bit), doubled for
fp32, and shrink to the layer inputs plus one live layer with activation checkpointing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.presets import PRESETS, count_parameters

GIB = 1 << 30
# Framework, allocator and communication buffers per process, measured loosely.
RUNTIME_OVERHEAD_BYTES = GIB // 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank; `total_bytes` is what must fit on the device."""

    model: str
    strategy: str
    world_size: int
    precision: str
    n_params: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    overhead_bytes: int
    offloaded_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.activations_bytes + self.overhead_bytes)

    def format(self) -> str:
        rows = [("parameters", self.params_bytes), ("gradients", self.grads_bytes),
                ("optimizer (AdamW)", self.optimizer_bytes),
                ("activations", self.activations_bytes), ("runtime overhead", self.overhead_bytes)]
        lines = [f"{self.model}: {self.n_params / 1e6:.1f}M params, {self.strategy.upper()} x "
                 f"{self.world_size} rank(s), {self.precision}; per rank:"]
        lines += [f"  {name:<18} {_gib(n)}" for name, n in rows]
        lines.append(f"  {'total':<18} {_gib(self.total_bytes)}")
        if self.offloaded_bytes:
            lines.append(f"  (+ {_gib(self.offloaded_bytes)} offloaded to host memory)")
        return "\n".join(lines)


def estimate(config: TrainerConfig, world_size: int) -> MemoryEstimate:
    """Per-rank memory of `config` at `world_size` ranks."""
    if world_size < 1:
        raise ValueError("world size must be >= 1")
    shape = dataclasses.replace(PRESETS[config.model], vocab_size=config.vocab_size)
    n = count_parameters(shape, config.seq_len)
    shard = world_size if config.strategy == "fsdp" else 1
    params, grads, optim = 4 * n // shard, 4 * n // shard, 8 * n // shard
    s, b, d = config.seq_len, config.micro_batch_size, shape.d_model
    scale = 2.0 if config.precision == "fp32" else 1.0
    per_layer = int(s * b * d * (34 + 5 * shape.n_head * s / d) * scale)
    if config.activation_checkpointing:
        layers = shape.n_layer * int(s * b * d * 2 * scale) + per_layer
    else:
        layers = shape.n_layer * per_layer
    logits = 3 * s * b * shape.vocab_size * 4  # logits, their fp32 copy, their gradient
    offloaded = 0
    if config.cpu_offload and config.strategy == "fsdp":
        offloaded, params, grads, optim = params + grads + optim, 0, 0, 0
    return MemoryEstimate(model=config.model, strategy=config.strategy, world_size=world_size,
                          precision=config.precision, n_params=n, params_bytes=params,
                          grads_bytes=grads, optimizer_bytes=optim,
                          activations_bytes=layers + logits,
                          overhead_bytes=RUNTIME_OVERHEAD_BYTES, offloaded_bytes=offloaded)


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


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
