"""What a worker process holds for its Sessions: the process groups (init_distributed), the
script's own collective (all_reduce), and how the process ends (run)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist

from elastrain_trainer import faults
from elastrain_trainer.checkpoint import catalog as cat
from elastrain_trainer.checkpoint.generations import Fence
from elastrain_trainer.checkpoint.manager import CheckpointManager
from elastrain_trainer.checkpoint.root import scan
from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.events import emit
from elastrain_trainer.faults import guard_main
from elastrain_trainer.inprocess.config import read_inprocess_config
from elastrain_trainer.inprocess.session import InProcessRuntime
from elastrain_trainer.loaders import install as _track_loaders
from elastrain_trainer.parallel import COLLECTIVE_TIMEOUT, DistEnv, Groups, read_dist_env
from elastrain_trainer.parallel import init_distributed as _init_all
from elastrain_trainer.session import stale_groups
from elastrain_trainer.session.dark_peers import DarkPeerWatch, start_dark_peer_watch


@dataclasses.dataclass
class Process:
    """What this process holds across Sessions: the Session's gloo groups and, with
    ELASTRAIN_RECOVERY=inProcess (docs/recovery.md), this node's side of the protocol."""

    groups: Groups | None = None
    inprocess: InProcessRuntime | None = None
    dark_peers: DarkPeerWatch | None = None  # Restart mode's (session.dark_peers)


process = Process()


def init_distributed() -> DistEnv:
    """Join torchrun's process group (gloo on CPU, NCCL for CUDA tensors) unless the script
    already did; returns where this process sits (rank, world_size, local_rank, device).
    Outside torchrun it is a world of one."""
    _track_loaders()  # the DataLoaders the script builds from now on follow the world
    stale_groups.install()  # a group of an earlier world is refused, not silently used
    denv = read_dist_env(os.environ)
    inprocess = read_inprocess_config(os.environ)
    if inprocess is not None:
        # Alone until the Session joins the job (Session.__enter__): build DDP on this.
        if process.inprocess is None:
            cfg = TrainerConfig.from_env(os.environ, [])
            process.inprocess = InProcessRuntime(inprocess, global_batch=cfg.global_batch_size,
                                                 micro_batch=cfg.micro_batch_size,
                                                 device=denv.device)
        return process.inprocess.env(denv)
    if not dist.is_initialized():
        process.groups = _init_all(denv)
    elif process.groups is None:
        # The script made its own default group: the session's small collectives get gloo
        # groups of their own (async DCP saves need gloo, and a thread of their own).
        control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        checkpoint = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        assert isinstance(control, dist.ProcessGroup)
        assert isinstance(checkpoint, dist.ProcessGroup)
        process.groups = Groups(control, checkpoint)
    if process.dark_peers is None:
        process.dark_peers = start_dark_peer_watch(dist.get_rank(), dist.get_world_size(),
                                                   process.groups.control)
    return dataclasses.replace(denv, rank=dist.get_rank(), world_size=dist.get_world_size())


def all_reduce(tensor: torch.Tensor,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               group: dist.ProcessGroup | None = None) -> None:
    """`dist.all_reduce` for a collective of the script's own inside a step's body (a loss
    averaged over ranks), on the default group or a `group` the script made for the current
    world (in Session(on_world_change=...)). In in-process mode a peer lost here is noted, not
    raised: the tensor is left as it is and the Session redoes the step at the next yield (a
    plain `dist.all_reduce` would raise out of the script's loop and end the process, which its
    launcher then restarts to rejoin). In restart mode it is `dist.all_reduce`."""
    if process.inprocess is None:
        dist.all_reduce(tensor, op=op, group=group)
    else:
        process.inprocess.peer_loss.all_reduce(tensor, op, group)


def note_peer_loss(error: BaseException) -> bool:
    """For a step's body whose collectives no hook catches (FSDP2 and HSDP: they run inside
    forward and backward): in in-process mode a lost peer's error caught there is noted, as
    DDP's comm hook notes one, and the body should apply nothing more and return; the Session
    regroups at its next yield and redoes the step. False in restart mode, or for an error that
    is not a lost peer: re-raise it then."""
    if process.inprocess is None or not faults.peer_lost(error):
        return False
    process.inprocess.peer_loss.note(error)
    return True


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process sits in one generation (Session(on_world_change=...) gets the old
    and the new one; the old one's world_size is 0 before the first)."""

    rank: int
    world_size: int


def destroy_process_groups() -> None:
    process.groups = None
    if dist.is_initialized():
        dist.destroy_process_group()


def run(main: Callable[[], object]) -> NoReturn:
    """Run a worker's main and exit the way the launcher and the operator read exits: a crash
    exits 1 with its exception recorded (counted against restartPolicy.maxRestarts), a lost peer
    EXIT_RESTART (restarted in place, uncounted); an int that main returns is the exit code."""
    code = guard_main(lambda: exit_code(main()))
    sys.stdout.flush()
    sys.stderr.flush()
    # A background upload blocked on a dead peer must not keep a failed worker alive.
    os._exit(code)


def exit_code(result: object) -> int:
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def checkpoint_fence() -> Fence | None:
    """What the Session's CheckpointManager asks before a commit: in-process mode's member
    (inprocess.fence), or the torchrun group's (session.restart_fence); None outside both."""
    if process.inprocess is not None:
        return process.inprocess.member.fence
    return process.dark_peers.fence if process.dark_peers is not None else None


def record_group_generation(manager: CheckpointManager) -> None:
    """Restart mode, the worker group's coordinator once its checkpoint root is read: the
    group's lineage and generation (session.restart_fence's `found`: a new store continues the
    bucket's line), and the bucket told of the generation before the group commits in it
    (manager.mark_generation), as an in-process world's coordinator tells it at a regroup."""
    fence = process.dark_peers.fence if process.dark_peers is not None else None
    if fence is None or process.inprocess is not None:
        return
    try:
        lineage, gen = fence.found(
            lambda: cat.line_of(manager.catalog or scan(manager.storage), manager.run))
    except Exception as e:  # the group keeps its store's incarnation as its lineage
        emit("generation_unfounded", error=str(e)[:200],
             note="this group's commits are compared only with its own store's groups")
        return
    manager.mark_generation(lineage, gen)


def training_ended() -> None:
    """The Session's loop ended (finished, stopping, or left): Restart mode's dark-peer watch
    stops judging (session.dark_peers)."""
    if process.dark_peers is not None:
        process.dark_peers.quiet()
