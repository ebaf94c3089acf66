"""FSDP2 (`fully_shard`) at a new world, in the same process (docs/recovery.md section 5).

The mesh is baked into every sharded parameter, so a new world means a new module: the
script's `build(mesh)` makes one on a mesh over the new default group, its
shards are filled from the rows this node holds, and the script's own objects become the new
ones (the model by class and instance state, the optimizer by instance state), so `model`,
`optimizer` and a scheduler holding that optimizer keep working.

The rows move in two places, each with one `all_to_all_single` per dtype:
- with notice, on the *old* group before it is destroyed (`handover`): every node of the old
  world, the leavers included, sends each survivor the rows of its new chunk (`reshard.py`:
  the survivors' layout). A leaver's shards exist nowhere else; this is their handover.
- on the *new* group (`settle`): from the layout the survivors hold to the plan's, a joiner
  receiving its chunk and, from rank 0, what is not sharded (buffers, AdamW's step counts,
  the optimizer's hyper-parameters, the Session's step and other objects).
A start generation takes rank 0's whole model (each node built it alone) the same way, as DDP
takes rank 0's broadcast. Without notice the dead node's rows are gone: the caller falls back
to the restart from the newest checkpoint (`FsdpRuntime.lost_shards`).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from elastrain_trainer.inprocess import nccl
from elastrain_trainer.inprocess.membership import Plan
from elastrain_trainer.inprocess.reshard import chunk_rows, row_moves
from elastrain_trainer.inprocess.transfer import TransferError
from elastrain_trainer.private_hooks import import_private

# Private (elastrain_trainer.private_hooks): which FSDP state a module object answers to.
_module_state_mapping = import_private(
    "torch.distributed._composable_state", "_module_state_mapping", library="torch",
    needed_for="for FSDP2 in-process recovery (inprocess/fsdp.py)")
_get_module_state = import_private(
    "torch.distributed._composable_state", "_get_module_state", library="torch",
    needed_for="for FSDP2 in-process recovery (inprocess/fsdp.py)")

Key = tuple[str, ...]  # ("p", fqn) a parameter, ("b", fqn) a buffer, ("o", fqn, name) its state
Build = Callable[[DeviceMesh], tuple[nn.Module, torch.optim.Optimizer]]
_meshes = itertools.count(1)


@dataclasses.dataclass
class Held:
    """What one node holds between two groups: its chunk of every sharded tensor, in `layout`
    (empty for a node outside it), the replicated tensors, and each sharded tensor's full shape
    and dtype (the same on every node)."""

    layout: tuple[str, ...]
    rows: dict[Key, torch.Tensor]
    whole: dict[Key, Any]
    meta: dict[Key, tuple[tuple[int, ...], torch.dtype]]


@dataclasses.dataclass
class Header:
    """Rank 0's word to the new group: where the rows are and what is not sharded."""

    layout: tuple[str, ...]
    meta: dict[Key, tuple[tuple[int, ...], torch.dtype]]
    whole: dict[Key, Any]
    hyper: list[dict[str, Any]]
    step: int
    extras: dict[str, Any]


# fully_shard's placements on a 1-D mesh (FSDP) and on a 2-D one (HSDP: replicate, shard).
FSDP_PLACEMENTS = (Shard(0),)
HSDP_PLACEMENTS = (Replicate(), Shard(0))


def sharded_params(model: nn.Module, placements: tuple[Placement, ...] = FSDP_PLACEMENTS
                   ) -> dict[str, DTensor]:
    """The parameters by name; refuses anything but fully_shard's default sharding on a mesh
    of `placements`' dimensions, the only ones `reshard.py` and inprocess/hsdp.py know."""
    out: dict[str, DTensor] = {}
    for name, p in model.named_parameters():
        if not (isinstance(p, DTensor) and tuple(p.placements) == placements):
            raise ValueError(f"in-process recovery: parameter {name!r} is not sharded as "
                             f"fully_shard's default {placements}; tensor parallelism and "
                             "unsharded parameters are not implemented")
        out[name] = p
    return out


def placements_of(model: nn.Module) -> tuple[Placement, ...] | None:
    """The first parameter's placements (None: not a DTensor)."""
    p = next(iter(model.parameters()), None)
    return tuple(p.placements) if isinstance(p, DTensor) else None


def is_fsdp(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def hold(model: nn.Module, optimizer: torch.optim.Optimizer, layout: Sequence[str],
         placements: tuple[Placement, ...] = FSDP_PLACEMENTS) -> Held:
    """This node's rows as they are (its chunk of `layout`), without a copy."""
    params = sharded_params(model, placements)
    names = {id(p): n for n, p in params.items()}
    rows: dict[Key, torch.Tensor] = {}
    whole: dict[Key, Any] = {}
    meta: dict[Key, tuple[tuple[int, ...], torch.dtype]] = {}
    for n, p in params.items():
        rows["p", n], meta["p", n] = p.to_local().detach(), (tuple(p.shape), p.dtype)
    for n, b in model.named_buffers():
        whole["b", n] = b.detach()
    for param, state in optimizer.state.items():
        n = names[id(param)]
        for k, v in state.items():
            if isinstance(v, DTensor):
                if tuple(v.placements) != placements:
                    raise ValueError(f"in-process recovery: optimizer state {k!r} of {n!r} is "
                                     f"sharded as {v.placements}, not {placements}")
                rows["o", n, k], meta["o", n, k] = v.to_local().detach(), (tuple(v.shape),
                                                                          v.dtype)
            else:
                whole["o", n, k] = v
    return Held(tuple(layout), rows, whole, meta)


def exchange(held: Held, target: Sequence[str], group: Sequence[str], me: str) -> Held:
    """Every rank of the current default group (`group`: its nodes in rank order) calls this
    with the same layouts and meta; returns this node's rows in `target` (none outside it)."""
    rank = {n: i for i, n in enumerate(group)}
    if not set(held.layout) | set(target) <= set(rank):
        raise ValueError(f"layouts {held.layout} -> {tuple(target)} outside group {group}")
    mine = list(target).index(me) if me in target else None
    at = list(held.layout).index(me) if me in held.layout else None
    out: dict[Key, torch.Tensor] = {}
    sends: dict[torch.dtype, list[list[torch.Tensor]]] = defaultdict(
        lambda: [[] for _ in group])
    recvs: dict[torch.dtype, list[list[torch.Tensor]]] = defaultdict(
        lambda: [[] for _ in group])
    traffic: set[torch.dtype] = set()  # every rank derives the same set: all moves are known
    for key in sorted(held.meta):
        shape, dtype = held.meta[key]
        rows, tail = shape[0], shape[1:]
        start = chunk_rows(rows, len(target), mine)[0] if mine is not None else 0
        if mine is not None:
            stop = chunk_rows(rows, len(target), mine)[1]
            out[key] = torch.empty((stop - start, *tail), dtype=dtype)
        hstart = chunk_rows(rows, len(held.layout), at)[0] if at is not None else 0
        for mv in row_moves(rows, held.layout, target):
            if mv.src != mv.dst:
                traffic.add(dtype)
            if mv.src == me:
                piece = held.rows[key][mv.start - hstart:mv.stop - hstart]
                if mv.dst == me:
                    out[key][mv.start - start:mv.stop - start].copy_(piece)
                else:
                    sends[dtype][rank[mv.dst]].append(piece.detach().cpu())
            elif mv.dst == me:
                recvs[dtype][rank[mv.src]].append(out[key][mv.start - start:mv.stop - start])
    for dtype in sorted(traffic, key=str):
        send = [t.reshape(-1) for ts in sends[dtype] for t in ts]
        in_splits = [sum(t.numel() for t in ts) for ts in sends[dtype]]
        out_splits = [sum(v.numel() for v in vs) for vs in recvs[dtype]]
        flat_in = torch.cat(send) if send else torch.empty(0, dtype=dtype)
        flat_out = torch.empty(sum(out_splits), dtype=dtype)
        dist.all_to_all_single(flat_out, flat_in, out_splits, in_splits)
        offset = 0
        for vs in recvs[dtype]:
            for v in vs:
                v.copy_(flat_out[offset:offset + v.numel()].view(v.shape))
                offset += v.numel()
    return Held(tuple(target), out, held.whole, held.meta)


def hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def new_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """A mesh over the current default group (FSDP: (world,); HSDP: (pods, ranks per pod)).
    Of its own names: DeviceMesh equality ignores the rank and the group, and a mesh of an
    earlier generation equal to this one's is still cached inside DTensor, so fully_shard's
    default mesh came back with the old generation's coordinate here (two ranks then held
    "chunk 1" and DCP's save refused the plan)."""
    n = next(_meshes)
    device = "cuda" if nccl.has_device_backend(None) else "cpu"  # the generation's device
    return init_device_mesh(device, shape,
                            mesh_dim_names=tuple(f"elastrain_{n}_{d}" for d in range(len(shape))))


def rebuild(model: nn.Module, optimizer: torch.optim.Optimizer, build: Build, held: Held,
            groups: list[dict[str, Any]], mesh: DeviceMesh | None = None) -> None:
    """`build(mesh)` on the current default group (default: FSDP's 1-D mesh), its shards filled
    from `held` (this node's chunk of the current plan), then the script's `model` and
    `optimizer` become the new ones."""
    mesh = mesh if mesh is not None else new_mesh((dist.get_world_size(),))
    placements = FSDP_PLACEMENTS if mesh.ndim == 1 else HSDP_PLACEMENTS
    # The build draws from the global RNG (parameter init); the training must not see it.
    with torch.random.fork_rng(devices=[]):
        fresh, fresh_opt = build(mesh)
    params = sharded_params(fresh, placements)
    if stray := [n for n, p in params.items() if p.device_mesh is not mesh]:
        raise ValueError(f"build(mesh) must shard on the mesh it is given: {stray[:3]}")
    want = {k[1] for k in held.meta if k[0] == "p"}
    if set(params) != want:
        raise TransferError(f"build(mesh) made parameters {sorted(set(params) ^ want)[:5]} that "
                            "differ from the running model's")
    if any(t.is_meta for t in [*fresh.parameters(), *fresh.buffers()]):
        raise ValueError("build(mesh) must return a materialised model (to_empty after "
                         "fully_shard on the meta device), not one on the meta device")
    with torch.no_grad():
        for n, p in params.items():
            local, rows = p.to_local(), held.rows["p", n]
            if tuple(local.shape) != tuple(rows.shape):
                raise TransferError(f"{n}: the new shard is {tuple(local.shape)}, the rows "
                                    f"received {tuple(rows.shape)}")
            local.copy_(rows)
        for n, b in fresh.named_buffers():
            b.copy_(held.whole["b", n])
        for key, (shape, dtype) in held.meta.items():
            if key[0] == "o":
                like = cast(DTensor, torch.zeros_like(params[key[1]], dtype=dtype))
                if tuple(like.shape) != shape:
                    raise TransferError(f"{key}: {shape} received, {tuple(like.shape)} here")
                like.to_local().copy_(held.rows[key])
                fresh_opt.state[params[key[1]]][key[2]] = like
        for key, value in held.whole.items():
            if key[0] == "o":
                fresh_opt.state[params[key[1]]][key[2]] = (
                    value.clone() if isinstance(value, torch.Tensor) else value)
    if len(groups) != len(fresh_opt.param_groups):
        raise TransferError(f"build(mesh)'s optimizer has {len(fresh_opt.param_groups)} param "
                            f"groups, the running one {len(groups)}")
    for group, values in zip(fresh_opt.param_groups, groups, strict=True):
        group.update(values)  # the LR a scheduler set, weight decay, ...
    become(model, fresh)
    adopt(optimizer, fresh_opt)


def become(model: nn.Module, fresh: nn.Module) -> None:
    """The script's `model` object turns into `fresh` (class and instance state; FSDP2 looks its
    state up by module object, so `model` is registered for it too)."""
    state = _get_module_state(fresh)
    model.__class__ = fresh.__class__
    model.__dict__ = fresh.__dict__
    _module_state_mapping[model] = weakref.ref(state)


def adopt(optimizer: torch.optim.Optimizer, fresh: torch.optim.Optimizer) -> None:
    """The script's optimizer takes `fresh`'s parameters and state; the hooks registered on it
    and a scheduler's `step` wrapper stay."""
    keep = {k: v for k, v in optimizer.__dict__.items() if k.endswith("_hooks") or k == "step"}
    optimizer.__dict__.update(fresh.__dict__)
    optimizer.__dict__.update(keep)


class ShardsLostError(RuntimeError):
    """A node whose rows the new plan needs is not in it (lost after the handover)."""


class Resharder:
    """FSDP2 in a Member's changes: `handover` on the old group, `settle` on the new one."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, build: Build) -> None:
        sharded_params(model)  # refuse what cannot be resharded before the job starts
        self.model, self.optimizer, self.build = model, optimizer, build
        self.held: Held | None = None

    def handover(self, old: Plan, plan: Plan, me: str) -> None:
        """Every node of `old`, once `plan` (a change, not a stop) is published and before the
        old group goes: the survivors' rows, the leavers' included, moved to the survivors."""
        survivors = tuple(n for n in plan.nodes if n in old.nodes)
        held = hold(self.model, self.optimizer, old.nodes)
        if survivors and survivors != tuple(old.nodes):
            held = exchange(held, survivors, old.nodes, me)
        self.held = held if me in survivors else None

    def settle(self, plan: Plan, me: str, step: int,
               extras: dict[str, Any]) -> tuple[int, dict[str, Any], bool]:
        """On `plan`'s group: rank 0 says where the rows are, each node gets its chunk and the
        model and optimizer are rebuilt at this world. Returns (step, extras, healed): a node
        that held no rows (a joiner) takes rank 0's step and extras."""
        rank = plan.nodes.index(me)
        held = (hold(self.model, self.optimizer, (me,)) if rank == 0 else None
                ) if plan.reason == "start" else self.held
        self.held = None
        box: list[Header | None] = [None]
        if rank == 0:
            if held is None:
                raise ShardsLostError(f"generation {plan.gen}: rank 0 ({me}) holds no rows")
            box = [Header(held.layout, held.meta, held.whole, hyper(self.optimizer), step,
                          extras)]
        dist.broadcast_object_list(box, src=0)
        header = box[0]
        assert header is not None
        if lost := sorted(set(header.layout) - set(plan.nodes)):
            raise ShardsLostError(f"generation {plan.gen}: the rows held by {lost} are gone "
                                  "(lost after the handover)")
        mine = Held(header.layout, held.rows if held is not None else {}, header.whole,
                    header.meta)
        got = exchange(mine, plan.nodes, plan.nodes, me)
        rebuild(self.model, self.optimizer, self.build, got, header.hyper)
        if held is None and plan.reason != "start":
            return header.step, header.extras, True
        return step, extras, False
