"""HSDP (FSDP2 on a (pods, ranks per pod) mesh) at a new world, in the same process (issue 35
item 2; docs/recovery.md section 5).

Every pod holds a whole replica, cut into the same `ranks per pod` chunks: local rank i holds
chunk i of every sharded tensor in every pod. A change of world adds or removes whole pods (the
plan's units), so the chunk a surviving rank holds is still its chunk at the new world: nothing
moves for it, with notice or without (a lost pod takes one replica with it, not a shard nobody
else has), and no checkpoint is loaded. What moves:
- a joining pod's ranks (and a survivor rank whose step did not commit) receive their chunk
  from the rank at the same local position of a source pod (the plan's heal map), with the
  rows of `fsdp.exchange` run per pod: source pod -> target pod, one all_to_all per dtype where
  anything moves;
- from the first node that holds the step, what is not sharded (buffers, AdamW's step counts,
  the optimizer's hyper-parameters, the Session's step and objects).
A start generation takes rank 0's whole model (each node built it alone, on a (1, 1) mesh),
every pod its chunks of it, as FSDP's start does. Then each node rebuilds the module on the new
mesh (`fsdp.rebuild`) and fills it from its chunk.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from elastrain_trainer.inprocess.fsdp import (
    HSDP_PLACEMENTS,
    Build,
    Header,
    Held,
    ShardsLostError,
    exchange,
    hold,
    hyper,
    new_mesh,
    rebuild,
    sharded_params,
)
from elastrain_trainer.inprocess.membership import Plan, unit_of
from elastrain_trainer.inprocess.transfer import TransferError


def is_hsdp(model: nn.Module) -> bool:
    """fully_shard on a 2-D mesh: what `strategy: hsdp` (parallel.wrap_model) makes."""
    try:
        sharded_params(model, HSDP_PLACEMENTS)
    except ValueError:
        return False
    return True


def pods(plan: Plan) -> list[tuple[str, ...]]:
    """The plan's units (pods) in rank order, each its nodes in local-rank order."""
    out: dict[str, list[str]] = {}
    for n in plan.nodes:
        out.setdefault(unit_of(n), []).append(n)
    return [tuple(ns) for ns in out.values()]


class HsdpResharder:
    """HSDP in a Member's changes: nothing to hand over on the old group (every chunk lives in
    another pod too); `settle` on the new one."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, build: Build) -> None:
        sharded_params(model, HSDP_PLACEMENTS)  # refuse what this cannot regroup, at start
        self.model, self.optimizer, self.build = model, optimizer, build

    def handover(self, old: Plan, plan: Plan, me: str) -> None:
        """Nothing: a leaving pod's chunks are the same as every other pod's."""

    def settle(self, plan: Plan, me: str, step: int,
               extras: dict[str, Any]) -> tuple[int, dict[str, Any], bool]:
        """On `plan`'s group: each pod that is new or behind gets its chunks from its source
        pod, the first node holding the step says what is not sharded, and the model and
        optimizer are rebuilt on the new mesh. Returns (step, extras, healed)."""
        units = pods(plan)
        per_pod = len(units[0])
        if any(len(u) != per_pod for u in units):
            raise ValueError(f"generation {plan.gen}: pods of unequal size {units}")
        start = plan.reason == "start"
        # A collective that failed mid-forward leaves blocks unsharded: back to their chunks
        # (local: it frees the gathered parameters) before the chunks are read.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        src = 0 if start else next(i for i, n in enumerate(plan.nodes) if n not in plan.heal)
        holds = (start and plan.nodes.index(me) == src) or (not start and me not in plan.heal)
        mine = hold(self.model, self.optimizer, (me,), HSDP_PLACEMENTS) if holds else None
        box: list[Header | None] = [None]
        if plan.nodes[src] == me:
            assert mine is not None
            box = [Header(mine.layout, mine.meta, mine.whole, hyper(self.optimizer), step,
                          extras)]
        dist.broadcast_object_list(box, src=src)
        header = box[0]
        assert header is not None
        got: Held | None = None
        for unit in units:
            # Where this pod's chunks come from: rank 0's whole model at a start, else the
            # pod itself, or its source pod when it is new or behind.
            behind = [n for n in unit if n in plan.heal]
            layout = ((plan.nodes[src],) if start
                      else pods_of(plan, plan.heal[behind[0]]) if behind else unit)
            if me in layout and mine is None:
                raise ShardsLostError(f"generation {plan.gen}: {me} is to send rows it does "
                                      "not hold")
            rows = dict(mine.rows) if mine is not None and me in layout else {}
            out = exchange(Held(layout, rows, header.whole, header.meta), unit, plan.nodes, me)
            if me in unit:
                got = out
        assert got is not None
        check_replicas(got, units, me, plan.gen)
        mesh = new_mesh((len(units), per_pod))
        rebuild(self.model, self.optimizer, self.build, got, header.hyper, mesh)
        if not holds and not start:
            return header.step, header.extras, True
        return step, extras, False


def check_replicas(held: Held, units: list[tuple[str, ...]], me: str, gen: int) -> None:
    """Every pod's chunk i is the same rows, or no node trains on them: one float64 sum per
    node, gathered (a chunk healed from the wrong position, or corrupted in flight, would
    otherwise train on silently as a replica that differs from the others)."""
    total = sum((float(t.double().sum()) for _, t in sorted(held.rows.items())), 0.0)
    sums: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sums, (me, total))
    seen = dict(sums)
    for position in range(len(units[0])):
        values = {unit[position]: seen[unit[position]] for unit in units}
        if len(set(values.values())) > 1:
            raise TransferError(f"generation {gen}: the replicas' chunk {position} differ "
                                f"after the regroup: {values}")


def pods_of(plan: Plan, node: str) -> tuple[str, ...]:
    """The nodes of `node`'s pod in `plan`, in local-rank order."""
    unit = unit_of(node)
    return tuple(n for n in plan.nodes if unit_of(n) == unit)
