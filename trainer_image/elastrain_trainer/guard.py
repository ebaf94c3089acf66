"""The loss-spike / grad-norm guard: decides whether an optimizer step is applied or skipped.

Every rank sees the same all-reduced loss and the same global grad norm, so every rank
reaches the same verdict without another collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Running means are exponential so one old outlier stops mattering after a few dozen steps.
EMA_DECAY = 0.9
# Spikes are judged only once the mean has seen this many good steps.
MIN_HISTORY = 5


@dataclass
class SpikeGuard:
    """Skips non-finite steps and steps whose loss or grad norm exceeds factor x running mean.

    factor == 0 turns the guard off (every step is applied).
    """

    factor: float
    loss_mean: float = 0.0
    grad_norm_mean: float = 0.0
    good_steps: int = 0
    skipped_steps: int = 0

    def should_skip(self, loss: float, grad_norm: float) -> str | None:
        """The reason to skip this step, or None to apply it (pure: updates nothing)."""
        if self.factor <= 0:
            return None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "non-finite loss or grad norm"
        if self.good_steps >= MIN_HISTORY:
            if loss > self.factor * self.loss_mean:
                return f"loss {loss:.4g} > {self.factor} x mean {self.loss_mean:.4g}"
            if grad_norm > self.factor * self.grad_norm_mean:
                return f"grad norm {grad_norm:.4g} > {self.factor} x mean {self.grad_norm_mean:.4g}"
        return None

    def observe(self, loss: float, grad_norm: float, skipped: bool) -> None:
        """Fold one step's outcome into the running means (skipped steps are not folded)."""
        if skipped:
            self.skipped_steps += 1
            return
        if self.good_steps == 0:
            self.loss_mean, self.grad_norm_mean = loss, grad_norm
        else:
            self.loss_mean = EMA_DECAY * self.loss_mean + (1 - EMA_DECAY) * loss
            self.grad_norm_mean = EMA_DECAY * self.grad_norm_mean + (1 - EMA_DECAY) * grad_norm
        self.good_steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"loss_mean": self.loss_mean, "grad_norm_mean": self.grad_norm_mean,
                "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_mean = float(state["loss_mean"])
        self.grad_norm_mean = float(state["grad_norm_mean"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
