"""What a checkpoint holds and how it goes back into live objects.

Model and optimizer are checkpointed by the Session (elastrain_trainer.api.ModelState and
OptimizerState, torch's distributed state-dict helpers), so DDP and FSDP states are sharded
DTensors or plain tensors as appropriate and load at any world size. The rest, here, is
small and identical on every rank: step, data position (samples consumed), LR scheduler,
grad scaler and guard. RNG is not stored: every random draw is seeded by (seed, step,
rank), which, unlike a saved generator state, still means something after the world
size changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elastrain_trainer.guard import SpikeGuard


@dataclass
class Progress:
    """Where training is; `samples_seen` is the data-loader position (global sample index)."""

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    last_loss: float | None = None


@dataclass
class TrainObjects:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    guard: SpikeGuard
    progress: Progress


def trainer_state(t: TrainObjects) -> dict[str, Any]:
    """Everything but model and optimizer (those go through torch's distributed state-dict
    helpers, elastrain_trainer.api.ModelState/OptimizerState)."""
    p = t.progress
    return {
        "step": p.step, "samples_seen": p.samples_seen, "tokens_seen": p.tokens_seen,
        "last_loss": p.last_loss, "scheduler": t.scheduler.state_dict(),
        "scaler": t.scaler.state_dict(), "guard": t.guard.state_dict(),
    }


def apply_trainer_state(t: TrainObjects, tr: dict[str, Any]) -> None:
    """Push a loaded trainer_state() back into the live objects."""
    t.progress.step = int(tr["step"])
    t.progress.samples_seen = int(tr["samples_seen"])
    t.progress.tokens_seen = int(tr["tokens_seen"])
    t.progress.last_loss = tr["last_loss"]
    t.scheduler.load_state_dict(tr["scheduler"])
    if tr["scaler"]:
        t.scaler.load_state_dict(tr["scaler"])
    t.guard.load_state_dict(tr["guard"])


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of one rank's step (for dropout-like randomness, if a model uses any)."""
    return (seed * 1_000_003 + step * 7919 + rank) % (2**63)
