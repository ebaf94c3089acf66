"""What the Session needs of in-process recovery (api.py calls it; this never imports api).

`init_distributed()` in in-process mode starts a node alone (a private world of one, so the
script can build its DDP before it is admitted) and returns a `LiveDistEnv`, whose `rank` and
`world_size` read the current generation (and raise before the first: no false world of one):
the README's loop, which reads `env.rank` inside the loop, runs unchanged. The Session then
joins, and at each change settles (heal, re-wrap).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from elastrain_trainer import faults, metrics
from elastrain_trainer.events import emit
from elastrain_trainer.inprocess import fsdp, hsdp, nccl, rewrap, transfer, user_groups
from elastrain_trainer.inprocess.config import InProcessConfig
from elastrain_trainer.inprocess.fsdp import Build
from elastrain_trainer.inprocess.hold import hold_budget_s, wait_for_joiner
from elastrain_trainer.inprocess.member import (
    Member,
    MemberConfig,
    NotHealedError,
    StoreFoundedError,
)
from elastrain_trainer.inprocess.membership import Plan, PlanConfig
from elastrain_trainer.inprocess.peerloss import PeerLoss
from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.inprocess.store_client import StoreUnansweredError
from elastrain_trainer.parallel import DistEnv
from elastrain_trainer.signals import EXIT_RESTART, EXIT_STORE_LOST

T = TypeVar("T")


class PeerLostInSettle(RuntimeError):
    """A peer was lost during a heal or the re-wrap after it (its message: the collective's
    error). Raised without its cause: the failed collective's frames would keep the group."""


class StatefulLike(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class WorldNotKnownError(RuntimeError):
    """A node's rank or world size read before the Session planned it into a generation."""


class LiveDistEnv(DistEnv):
    """A DistEnv whose rank and world size are the current generation's. Before the Session
    planned this node in there is no true value (a joiner's rank is decided by the job's plan),
    so reading them raises WorldNotKnownError rather than answer rank 0 of a world of one."""

    _member: Member | None = None

    def _unknown(self, name: str) -> NoReturn:
        raise WorldNotKnownError(
            f"env.{name} is not known before `with Session(...)` in in-process recovery "
            "(ELASTRAIN_RECOVERY=inProcess): a node's rank and the world size are decided when "
            f"the job plans it in. Read env.{name} (or session.{name}) inside the Session; a "
            "DistributedSampler or ElasticSampler is split over each world by the Session, and "
            "session.accum gives the accumulation at the current world size")

    def __repr__(self) -> str:
        m = type(self)._member
        known = m is not None and m.plan is not None
        where = f"rank={self.rank}, world_size={self.world_size}" if known else "not planned in"
        return f"LiveDistEnv({where}, local_rank={self.local_rank}, device={self.device})"

    @property  # type: ignore[override]
    def rank(self) -> int:
        m = type(self)._member
        if m is None or m.plan is None:
            self._unknown("rank")
        return m.rank

    @rank.setter
    def rank(self, value: int) -> None:
        self.__dict__["rank"] = value

    @property  # type: ignore[override]
    def world_size(self) -> int:
        m = type(self)._member
        if m is None or m.plan is None:
            self._unknown("world_size")
        return m.plan.world_size

    @world_size.setter
    def world_size(self, value: int) -> None:
        self.__dict__["world_size"] = value


def known_world_size(denv: DistEnv) -> int | None:
    """The world size, or None before an in-process node was planned into a generation."""
    try:
        return denv.world_size
    except WorldNotKnownError:
        return None


class InProcessRuntime:
    def __init__(self, cfg: InProcessConfig, *, global_batch: int, micro_batch: int,
                 device: torch.device | None = None) -> None:
        rewrap.check_supported()
        self.cfg = cfg
        on_gpu = device is not None and device.type == "cuda"
        if on_gpu:  # before any NCCL group exists (inprocess.nccl)
            assert device is not None
            handling = nccl.prepare_error_handling(os.environ)
            torch.cuda.set_device(device)
            emit("inprocess_on_gpu", node=cfg.node_id, device=str(device),
                 async_error_handling=handling, experimental=True)
        self.member = self.needing_store(lambda: Member(MemberConfig(
            node_id=cfg.node_id, store_host=cfg.store_host, store_port=cfg.store_port,
            run_id=cfg.run_id, expected=cfg.replicas,
            plan=PlanConfig(global_batch, micro_batch, max_world=cfg.max_replicas,
                            min_world=cfg.min_replicas, ranks_per_node=cfg.ranks_per_node),
            heartbeat_timeout_s=cfg.heartbeat_timeout_s, spares=cfg.spares,
            desired=metrics.desired_replicas, on_role=metrics.record_role,
            moving=metrics.moving_pods, hold_budget_s=hold_budget_s(),
            lost=metrics.lost_pods, on_rejoin=metrics.record_rejoining,
            device=device if on_gpu else None)))
        metrics.watch_store(self.member.heartbeat.unanswered_s)
        self.member.wait_alone()
        user_groups.track(self.member.adopt_groups)  # the script's groups are severed too
        self.peer_loss = PeerLoss()

    def set_batch(self, global_batch: int, micro_batch: int) -> None:
        """The script's batch (its DataLoader's), not the job's defaults: the plan picks world
        sizes that keep this global batch (before join)."""
        plan = dataclasses.replace(self.member.cfg.plan, global_batch=global_batch,
                                   micro_batch=micro_batch)
        self.member.cfg = dataclasses.replace(self.member.cfg, plan=plan)

    def env(self, base: DistEnv) -> LiveDistEnv:
        live = LiveDistEnv(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
        LiveDistEnv._member = self.member
        return live

    def needing_store(self, change: Callable[[], T]) -> T:
        """Run a step of the protocol that needs the job's store. When it fails because the
        store is gone (its port does not answer), this process ends as a torchrun agent does
        on losing its rendezvous store (section 7): EXIT_STORE_LOST, which the launcher turns
        into a RendezvousConnectionError exit of the pod, so the pod is replaced and resumes
        from the newest checkpoint. Any other failure is raised as it is."""
        try:
            return change()
        except StoreFoundedError as e:
            self._store_lost(str(e))
        except StoreUnansweredError as e:  # its port may accept (a frozen process): lost too
            error = f"{type(e).__name__}: {e}"
        except dist.DistError as e:
            if MembershipStore.reachable(self.cfg.store_host, self.cfg.store_port):
                raise
            error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        self._store_lost(error)

    def _store_lost(self, error: str) -> NoReturn:
        print(f"elastrain: RendezvousConnectionError: the job's store {self.cfg.store_host}:"
              f"{self.cfg.store_port} is lost and a membership change needs it ({error}); "
              "this pod ends, to be replaced, resuming from the newest checkpoint",
              file=sys.stderr, flush=True)
        faults.record_reason(error)
        raise SystemExit(EXIT_STORE_LOST)

    def join(self) -> Plan:
        self.member.install_signal()
        plan = self.needing_store(self.member.join)
        self._export()
        return plan

    @property
    def sharded(self) -> bool:
        """FSDP2 or HSDP: the model is rebuilt at each world (a start shards rank 0's model
        before the checkpoint is loaded into it)."""
        return self.member.resharder is not None

    @property
    def shards_die_with_a_node(self) -> bool:
        """FSDP2: a lost node's shards are gone with it (no buddy copy), so a loss without
        notice restarts from the newest checkpoint instead of healing in process. HSDP keeps
        every chunk in every pod: a lost pod is one replica fewer."""
        return isinstance(self.member.resharder, fsdp.Resharder)

    def use(self, model: nn.Module, optimizer: torch.optim.Optimizer,
            build: Build | None) -> None:
        """The Session's model: DDP is re-wrapped in place, FSDP2 and HSDP rebuilt with
        `build`."""
        if fsdp.is_fsdp(model):
            if build is None:
                raise ValueError("ELASTRAIN_RECOVERY=inProcess with an FSDP2 model: "
                                 "Session(build=...) must give a function that builds the "
                                 "wrapped model and its optimizer on the current group")
            self.member.resharder = (hsdp.HsdpResharder(model, optimizer, build)
                                     if hsdp.is_hsdp(model)
                                     else fsdp.Resharder(model, optimizer, build))

    def settle(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
               stateful: Mapping[str, StatefulLike]) -> int:
        """Heal and re-wrap (FSDP2: reshard and rebuild) at the current generation; a healed
        node loads its source's `stateful` objects (the Session's step, a scheduler, ...).
        Returns the step."""
        extras = {name: obj.state_dict() for name, obj in stateful.items()}
        if self.member.last is not None and self.member.last.kept_group:
            return step  # the same group, DDP's Reducer and its comm hook as they were
        if isinstance(model, DDP):
            PeerLoss.detach(model)
        lost: str | None = None
        try:
            step, got = self.member.settle(model, optimizer, step=step, extras=extras)
        except fsdp.ShardsLostError as e:
            self._restart_from_checkpoint(str(e))
        except (transfer.TransferError, NotHealedError):
            raise  # not a loss: the state arrived different from what was sent, or a bug
        except RuntimeError as e:  # a send, a receive or DDP's check across ranks failed
            if self.sharded:
                raise  # FSDP2 shards part moved: the restart from the checkpoint
            lost = f"{type(e).__name__}: {e}"
        if lost is not None:
            raise PeerLostInSettle(lost)
        if self.member.last is not None and self.member.last.healed_from is not None:
            for name, obj in stateful.items():
                obj.load_state_dict(got[name])
        self.peer_loss.clear()
        if isinstance(model, DDP):
            self.peer_loss.attach(model, optimizer)
        self._export()
        return step

    def _restart_from_checkpoint(self, why: str) -> NoReturn:
        emit("shards_lost", node=self.member.node_id, reason=why)
        print(f"elastrain: {why}; this worker restarts in place and resumes from the newest "
              "checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_RESTART)

    def recover(self, model: nn.Module, step: int, error: str) -> Plan | None:
        """A peer was lost without notice: release this generation (DDP's hold on it
        included), report the committed `step`, enter the next one (None: this node is not in
        it). Call it outside the `except` block that caught the failure."""
        if isinstance(model, DDP):
            PeerLoss.detach(model)
        elif fsdp.is_fsdp(model):
            # A loss met inside forward or backward (noted by the body) can leave modules
            # unsharded: what the regroup keeps and hands on is each module's own shards.
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        plan = self.needing_store(lambda: self.member.recover(step, error, model=model))
        if plan is not None:
            self._export()
        return plan

    def wait_for_joiner(self, budget_s: float) -> None:
        """A local demo's pacing (hold.wait_for_joiner): a world smaller than the job's replicas
        waits until a pod asks to join (each of its ranks bumps `pending`: the wait ends once
        as many requests came as a pod has ranks, so the pod joins whole at the next boundary,
        not as one rank left waiting). Every rank reads the same store, so every rank of the
        world ends its wait; a store away ends it at once (nothing can join without it)."""
        m = self.member
        plan = m.plan
        ranks = m.cfg.plan.ranks_per_node
        if plan is None or plan.world_size >= m.cfg.expected * ranks:
            return
        with contextlib.suppress(dist.DistError):
            wait_for_joiner(m.node_id, plan.world_size,
                            lambda: m.store.pending() - plan.pending >= ranks,
                            lambda: m.signalled, budget_s)

    def boundary(self, step: int, *others: bool) -> tuple[bool, ...]:
        """Member.boundary, needing the store: one founded under this world ends this pod as a
        lost store does (every rank of the world agreed on it at this boundary)."""
        return self.needing_store(lambda: self.member.boundary(step, *others))

    def change(self, step: int) -> Plan | None:
        """A leave or join agreed at this step boundary: Member.change, needing the store."""
        return self.needing_store(lambda: self.member.change(step))

    def _export(self) -> None:
        # Code that reads torchrun's variables sees the current generation too.
        os.environ.update(RANK=str(self.member.rank),
                          WORLD_SIZE=str(self.member.plan.world_size if self.member.plan
                                         else 1))


def find_model(objects: Mapping[str, object]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The one model (DDP, or FSDP2's fully_shard) and the one optimizer that in-process mode
    re-wraps or rebuilds, and heals; other modules are the Session's extras."""
    modules = [o for o in objects.values()
               if isinstance(o, nn.Module) and (isinstance(o, DDP) or fsdp.is_fsdp(o))]
    optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
    if len(modules) != 1 or len(optimizers) != 1:
        raise ValueError("ELASTRAIN_RECOVERY=inProcess: Session(...) needs exactly one "
                         "DistributedDataParallel or fully_shard (FSDP2) module and one "
                         "optimizer (other shapes: not implemented yet, use recovery Restart); "
                         "plain modules beside it (an EMA copy) move like a scheduler")
    return modules[0], optimizers[0]
