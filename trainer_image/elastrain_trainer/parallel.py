"""Process groups and model wrapping: DDP or FSDP2 (fully_shard), autocast, checkpointing.

CPU ranks use gloo; CUDA ranks use NCCL for the model and gloo for the small control
collectives and checkpoint coordination ("cpu:gloo,cuda:nccl"), which DCP's async save
requires and which keep background uploads off the training communicator.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.events import emit
from elastrain_trainer.model import GPT
from elastrain_trainer.ports import free_port
from elastrain_trainer.private_hooks import import_private

# A private torch module (elastrain_trainer.private_hooks): a torch without it stops the worker.
checkpoint_wrapper = import_private(
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper",
    library="torch", needed_for="for activation checkpointing (parallel.py)")

# A dead peer normally fails gloo at once; this bounds the cases where it does not.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job (from torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart_count: int
    device: torch.device

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def read_dist_env(env: Mapping[str, str]) -> DistEnv:
    """torchrun's variables; a plain `python -m elastrain_trainer` is a world of one."""
    local_rank = int(env.get("LOCAL_RANK", "0"))
    device = (torch.device("cuda", local_rank) if torch.cuda.is_available()
              else torch.device("cpu"))
    return DistEnv(rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
                   local_rank=local_rank,
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), device=device)


@dataclass(frozen=True)
class Groups:
    """gloo groups besides the default one.

    `control` carries the per-step stop agreement on the training thread; `checkpoint` carries
    DCP's collectives, which an async save runs on a background thread. Two threads must never
    issue collectives on one group: gloo matches them by order, so interleaved calls pair up
    wrongly and hang until the collective timeout.
    """

    control: dist.ProcessGroup
    checkpoint: dist.ProcessGroup


def init_distributed(denv: DistEnv) -> Groups:
    """Initialise the default group and the gloo groups of `Groups`."""
    if denv.device.type == "cuda":
        torch.cuda.set_device(denv.device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    if "MASTER_ADDR" not in os.environ:
        # Outside torchrun: a world of one with a private store on a free port.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1")
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    # new_group is itself collective: every rank creates both, in this order.
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    checkpoint = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    assert isinstance(control, dist.ProcessGroup) and isinstance(checkpoint, dist.ProcessGroup)
    return Groups(control, checkpoint)


def wrap_model(model: GPT, cfg: TrainerConfig, denv: DistEnv,
               mesh: DeviceMesh | None = None) -> nn.Module:
    """Apply activation checkpointing, then DDP or FSDP2 (on `mesh`, default: over the default
    group; HSDP: hsdp_mesh), per the config."""
    if cfg.activation_checkpointing:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if cfg.strategy == "ddp":
        if cfg.cpu_offload:
            raise ValueError("ELASTRAIN_CPU_OFFLOAD=1 requires ELASTRAIN_STRATEGY=fsdp")
        model.to(denv.device)
        ids = [denv.device.index] if denv.device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    # Offloading only means something when the compute device is not the host.
    offload = cfg.cpu_offload and denv.device.type == "cuda"
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    if not offload:
        model.to(denv.device)
    if cfg.strategy == "hsdp" and mesh is None:
        mesh = hsdp_mesh(denv)
        if dist.get_rank() == 0:  # what a user checks first when HSDP is slower than expected
            emit("hsdp_mesh", shape=list(mesh.shape), dims=list(mesh.mesh_dim_names or ()))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def hsdp_mesh(denv: DistEnv) -> DeviceMesh:
    """HSDP's 2-D mesh over the default group: replicate across pods, shard over a pod's local
    ranks (torchrun numbers a pod's ranks contiguously), so a shard's gathers stay in the pod.
    An in-process node builds its model in a world of one before it is admitted: (1, 1)."""
    world = dist.get_world_size()
    per_pod = denv.local_world_size if world > 1 else 1
    pods, rest = divmod(world, per_pod)
    if rest or pods < 1:
        raise ValueError(f"ELASTRAIN_STRATEGY=hsdp: world size {world} is not a multiple of "
                         f"the pod's {per_pod} ranks")
    return init_device_mesh(denv.device.type, (pods, per_pod),
                            mesh_dim_names=("replicate", "shard"))


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    yield


def autocast(cfg: TrainerConfig, device: torch.device) -> contextlib.AbstractContextManager[None]:
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[cfg.precision])
