"""Learning-rate schedules as pure functions of the step (warmup+cosine, warmup-stable-decay).

A pure function of the step makes the schedule survive any restart or world-size change:
the LambdaLR wrapper only needs its step count back from the checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Schedule:
    """Inputs of the LR curve; `kind` is "cosine" or "wsd"."""

    kind: str
    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    decay_fraction: float = 0.2


def lr_at(s: Schedule, step: int) -> float:
    """The learning rate used for optimizer step `step` (0-based)."""
    if s.warmup_steps > 0 and step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.kind == "cosine":
        span = max(1, s.total_steps - s.warmup_steps)
        progress = min(1.0, (step - s.warmup_steps) / span)
        return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))
    if s.kind == "wsd":
        decay_steps = max(1, round(s.decay_fraction * s.total_steps))
        decay_start = s.total_steps - decay_steps
        if step < decay_start:
            return s.lr
        progress = min(1.0, (step - decay_start) / decay_steps)
        return s.lr - (s.lr - s.min_lr) * progress
    raise ValueError(f"unknown LR schedule {s.kind!r}")


def build_scheduler(optimizer: torch.optim.Optimizer,
                    s: Schedule) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_at`; the optimizer's base lr must be `s.lr`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(s, step) / s.lr)
