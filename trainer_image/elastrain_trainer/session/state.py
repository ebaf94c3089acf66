"""What a Session checkpoints, by the names the script gave (api.Session's state), and the
checkpoint's JSON sidecar: modules and optimizers through torch's distributed state-dict
helpers (they load at any world size), anything else by its own state_dict/load_state_dict."""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# The session's own entry in the checkpoint (the step counter); users may not take this name.
PROGRESS_KEY = "elastrain"


def should_checkpoint(step: int, interval_steps: int, time_due: bool) -> bool:
    """Save after this step? (step-based locally; time-based already agreed by all ranks)."""
    return time_due or (interval_steps > 0 and step % interval_steps == 0)


class StepCounter(Protocol):
    step: int


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ModelState:
    """A module (plain, DDP or FSDP2) as DCP sees it: fully qualified names without a wrapper's
    `module.` prefix and sharded tensors as DTensors, so it loads at any world size."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState:
    """An optimizer's state keyed by parameter names of its model (not by position)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state_dict)


@dataclasses.dataclass
class Progress:
    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def build_state(objects: Mapping[str, object]) -> dict[str, Stateful]:
    """What to checkpoint, by the names the user gave: modules and optimizers through torch's
    distributed state-dict helpers, anything else by its own state_dict/load_state_dict.

    An optimizer's parameters are named after the module that holds them (an EMA copy or a
    frozen teacher may sit beside it); when several do, wrap them in one nn.Module."""
    if PROGRESS_KEY in objects:
        raise ValueError(f"Session(...): {PROGRESS_KEY!r} is reserved for the session's step")
    modules = [o for o in objects.values() if isinstance(o, nn.Module)]
    state: dict[str, Stateful] = {}
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            state[name] = ModelState(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            state[name] = OptimizerState(_owner(name, obj, modules), obj)
        elif isinstance(obj, Stateful):
            state[name] = obj
        else:
            raise ValueError(f"Session({name}=...): a {type(obj).__name__} has no "
                             "state_dict()/load_state_dict(); cannot checkpoint it")
    return state


def _owner(name: str, optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> nn.Module:
    """The one module whose parameters the optimizer updates (an EMA copy beside it is not)."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    owners = [m for m in modules if params & {id(p) for p in m.parameters()}]
    if len(owners) != 1:
        raise ValueError(f"Session({name}=optimizer) needs exactly one nn.Module beside it "
                         f"that holds its parameters, to name them; got {len(owners)}")
    return owners[0]


def build_sidecar(step: int, loss: float | None, world_size: int, job_name: str) -> dict[str, Any]:
    """The checkpoint's small JSON beside the shards (read without torch)."""
    return {"step": step, "loss": loss, "world_size": world_size, "job_name": job_name,
            "hostname": socket.gethostname(), "torch_version": torch.__version__,
            "time": time.time(), "source": "elastrain_trainer.api"}
