"""One node's side of the protocol (docs/recovery.md section 3), at step boundaries.

    member = Member(MemberConfig(...))
    member.wait_alone()                       # a world of one until admitted: build DDP on it
    model = DDP(net); optimizer = ...
    plan = member.join()                      # admitted: in generation plan.gen at its rank
    step = member.settle(model, optimizer, step=0, extras={})   # heal, re-wrap
    while step < total:
        try:
            train(step, member.plan); step += 1
            if member.boundary(step):          # a leave or join agreed by every rank
                if member.change(step) is None: break          # this node left
                step = member.settle(model, optimizer, step=step, extras=...)
        except RuntimeError as e:              # a collective failed: a peer is gone
            member.recover(step, e)
            step = member.settle(model, optimizer, step=step, extras=...)

The training loop owns the model, the optimizer and the committed step; this class owns the
store, the heartbeat, the plan and the process group's generation. What a node does before it
is in the world is its base class's (inprocess.admission), how it follows the job's store
through a loss that class's base's (inprocess.following); its config, errors and record of a
change are inprocess.member_config's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from elastrain_trainer import fault_injection
from elastrain_trainer.events import emit
from elastrain_trainer.inprocess import regroup, rewrap, transfer
from elastrain_trainer.inprocess.admission import Admission
from elastrain_trainer.inprocess.fence import StoreFence
from elastrain_trainer.inprocess.generation import Generation
from elastrain_trainer.inprocess.heartbeat import Heartbeat
from elastrain_trainer.inprocess.hold import LeaveHold
from elastrain_trainer.inprocess.member_config import (
    Change,
    EntryFailedError,
    MemberConfig,
    NotHealedError,
    PlanTimeoutError,
    Resharding,
    StoreFoundedError,
)
from elastrain_trainer.inprocess.membership import (
    Epoch,
    NoQuorumError,
    Plan,
    Requests,
    plan_generation,
    plan_stop,
    pod_of,
    successor_order,
)
from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.inprocess.store_client import TrainingClient, within_for
from elastrain_trainer.inprocess.stuck import StuckWatch, bound_for
from elastrain_trainer.parallel import Groups

__all__ = ["Change", "EntryFailedError", "Member", "MemberConfig", "NotHealedError",
           "PlanTimeoutError", "Resharding", "StoreFoundedError"]


class Member(Admission):
    def __init__(self, cfg: MemberConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        # The training thread's client: its boundary requests bounded (inprocess.store_client).
        self.client = TrainingClient(self._connect(), cfg.node_id,
                                     within_for(cfg.heartbeat_timeout_s))
        self.heartbeat = Heartbeat(
            self._connect, cfg.node_id, timeout_s=cfg.heartbeat_timeout_s,
            probe=lambda: MembershipStore.reachable(cfg.store_host, cfg.store_port),
            claim=self._keep_claim, on_failed=self._sever, on_rejoin=cfg.on_rejoin,
            learn=lambda gen, store: self.generation.learn(gen, store.listeners))
        self.epoch: Epoch | None = None  # the store's incarnation this node knows
        self.founded: Epoch | None = None  # a store founded under this world (section 7)
        self._reconnects = 0
        self.plan: Plan | None = None
        self.last: Change | None = None
        self.signalled = False
        self._leave_sent = False
        self.hold = LeaveHold(cfg.node_id, cfg.hold_budget_s, cfg.moving)
        self.dissolving = False  # the next generation is a stop (too few nodes remain)
        # A generation this node was to enter failed before its group existed, and the plan
        # after it does not name this node: the old group is gone, so no stop's save either.
        self.dropped = False
        self._stop_gen: int | None = None  # the stop generation whose save this node makes
        # This node's heal failed part way (a peer lost during it): its model holds no state
        # of the job's, so the next plan must heal it again (it reports step -1).
        self.unhealed = False
        self._join_seq = 0           # this node's newest join request
        self._desired_sent: int | None = None
        self._lost_sent: set[str] = set()  # nodes this one asked to leave for the operator
        self.resharder: Resharding | None = None  # FSDP2: set by the Session
        # The groups of the generation in use, and what the heartbeat ends when it fails.
        self.generation = Generation(cfg.node_id,
                                     lambda *a: self.store.publish_listeners(*a), cfg.device)
        # What the checkpoint manager asks before a commit: is this node still in the world?
        self.stuck = StuckWatch(cfg.node_id, bound_for(cfg.heartbeat_timeout_s),
                                lambda gen: (self.plan is not None and self.plan.gen == gen
                                             and not self.dissolving),
                                before_exit=self._announce_rejoin_now)
        self.fence = StoreFence(self._connect, lambda: (self.epoch, self.plan, self._stop_gen),
                                lambda: self.heartbeat.lost)

    # -- entering ------------------------------------------------------------------------
    def install_signal(self) -> None:
        """A SIGTERM means "leave at the next step boundary" (the handler only sets a flag)."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "signalled", True))

    def wait_alone(self) -> None:
        """A private world of one, so the script can build its DDP before it is admitted."""
        self.generation.wait_alone()

    @property
    def groups(self) -> Groups | None:
        """The Session's side groups of the generation in use (None: in none)."""
        return self.generation.groups

    def release(self, model: nn.Module | None) -> None:
        """Leave the current group and free it now (Generation.release)."""
        self.generation.release(model)

    def _enter(self, plan: Plan) -> None:
        t0 = time.monotonic()
        regroup.destroy()
        rank = plan.rank_of(self.node_id)
        assert rank is not None
        self.heartbeat.watch(plan.gen, plan.nodes, plan.spares, plan.lost)
        self.cfg.on_role("member")
        self.generation.forget()
        if plan.reason == "start":
            self.generation.form(plan.gen, plan.nodes, self.store.pg_store(plan.gen), rank,
                                 plan.world_size, regroup.ARRIVAL_TIMEOUT)
        else:
            self._arrive(plan)
            self._init_entered(plan, rank)
        self.store.ack(plan.gen, self.node_id, plan.step)
        self.plan = plan
        self.last = Change(plan, regroup_s=time.monotonic() - t0)

    def _keep(self, plan: Plan) -> None:
        """A plan whose members and ranks are the old ones (a spare arrived or left): the
        members keep their group, so nothing pauses but the agreement on the plan. The group
        was made under an older generation's store prefix, which nothing reads after init.
        Its sockets serve the new generation too, before the heartbeat watches it (a failure of
        it is severed), and its listeners are published under it (the old generations' keys
        are forgotten two generations on)."""
        self.generation.kept(plan.gen)
        self.heartbeat.watch(plan.gen, plan.nodes, plan.spares, plan.lost)
        self.store.ack(plan.gen, self.node_id, plan.step)
        self.plan = plan
        self.last = Change(plan, kept_group=True)

    def _arrive(self, plan: Plan) -> None:
        """Say this node is about to init `plan`'s group and wait until every planned node
        did. The init cannot be interrupted and waits ENTRY_INIT_TIMEOUT for a
        missing rank (then the in-place restart from the checkpoint), so it starts only once
        every node is there. EntryFailedError when a node that has not arrived is silent for
        the beats of a node that never reported (section 8), when another node found so first
        (the generation is marked failed) or a later plan exists. A start generation skips
        this: its nodes hold no state, the fallback loses nothing."""
        self.store.arrive(plan.gen, self.node_id)
        fault_injection.after_arrive()
        bound = regroup.ARRIVAL_TIMEOUT.total_seconds()
        deadline = time.monotonic() + bound
        while missing := set(plan.nodes) - self.store.arrived(plan.gen, plan.nodes):
            lost = missing & (self.heartbeat.silent() | self.heartbeat.dead())
            if lost or self.store.failed(plan.gen) or self.store.has_plan(plan.gen + 1):
                why = (f"{sorted(lost)} silent before entering" if lost
                       else "another node found a planned node gone")
                emit("entry_failed", node=self.node_id, gen=plan.gen, lost=sorted(lost),
                     missing=sorted(missing), reason=why)
                raise EntryFailedError(f"generation {plan.gen}: {why}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"generation {plan.gen}: {sorted(missing)} beat but did "
                                   f"not arrive within {bound:.0f} s")
            time.sleep(0.02)

    def _init_entered(self, plan: Plan, rank: int) -> None:
        """Form `plan`'s groups once every node arrived. A node lost inside the init (killed or
        frozen after it arrived) leaves the others waiting in gloo's rendezvous: bounded by
        ENTRY_INIT_TIMEOUT, after which the generation is failed here like one a node never
        arrived at (EntryFailedError: report, plan the next without the silent)."""
        try:
            self.generation.form(plan.gen, plan.nodes, self.store.pg_store(plan.gen), rank,
                                 plan.world_size, regroup.ENTRY_INIT_TIMEOUT)
        except dist.DistError as e:
            regroup.destroy()
            lost = sorted(set(plan.nodes) & (self.heartbeat.silent() | self.heartbeat.dead()))
            why = (f"the group's init failed ({' '.join(str(e).split())[:200]}); silent: "
                   f"{lost}")
            emit("entry_failed", node=self.node_id, gen=plan.gen, lost=lost, missing=[],
                 reason=why)
            raise EntryFailedError(f"generation {plan.gen}: {why}") from e

    @property
    def rank(self) -> int:
        assert self.plan is not None
        rank = self.plan.rank_of(self.node_id)
        assert rank is not None
        return rank

    # -- after entering a generation: the same state everywhere -------------------------
    def settle(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
               extras: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Heal the nodes the plan names (point to point from their sources), then re-wrap
        DDP at this world. Returns the step to train next and the extras (a healed node's are
        its source's)."""
        assert self.plan is not None and self.last is not None
        t0 = time.monotonic()
        plan = self.plan
        if self.last.kept_group:
            return step, extras
        # Until the heal below completes, a receiver's model is part old, part received.
        self.unhealed = self.unhealed or self.node_id in plan.heal
        if self.resharder is not None:
            step, extras, healed = self.resharder.settle(plan, self.node_id, step, extras)
            if healed:
                self.last.healed_from = plan.heal.get(self.node_id, plan.nodes[0])
        for node, source in {} if self.resharder is not None else plan.heal.items():
            if source == self.node_id:
                transfer.send_state(model, optimizer, step=step, extras=extras,
                                    dst=plan.nodes.index(node))
                self.last.sent_to.append(node)
            elif node == self.node_id:
                got = transfer.recv_state(model, optimizer, src=plan.nodes.index(source))
                step, extras = got.step, got.extras
                self.last.healed_from = source
        # A start generation's step is the checkpoint's, loaded by every node alike.
        if step != plan.step and plan.reason != "start":
            raise NotHealedError(f"{self.node_id} is at step {step}, generation {plan.gen} at "
                                 f"{plan.step}, and the plan heals it from nobody")
        self.unhealed = False
        if isinstance(model, DDP):
            rewrap.rewrap_ddp(model, sync=plan.reason == "start")
        self.last.heal_s = time.monotonic() - t0
        return step, extras

    # -- with notice -----------------------------------------------------------------------
    def boundary(self, step: int, *others: bool) -> tuple[bool, ...]:
        """The per-step agreement: (change, *others), each OR-ed over all ranks in one small
        all-reduce. `change` when this node was signalled (it asks to leave first, unless it
        holds: inprocess.hold) or, on the coordinator, when the store's `pending` counter moved
        since the plan."""
        assert self.plan is not None
        self._follow_store()
        founded = self.founded is not None
        plan = self.plan
        # While the store is away nothing can change: the leave waits for it. A store that does
        # not answer in time is away from then on (inprocess.store_client): the world trains on.
        change = self._leave_sent
        if self.client.away_since is None:
            with contextlib.suppress(dist.DistError):
                change = self.client.bounded(lambda: self._ask_store(plan, step))
        flags = torch.tensor([change, founded, *others], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        agreed = tuple(bool(v) for v in flags.tolist())
        if agreed[1]:  # every rank of the world ends at this boundary, together
            raise self._founded_error()
        return (agreed[0], *agreed[2:])

    def _ask_store(self, plan: Plan, step: int) -> bool:
        """The boundary's requests: what this node tells the store, and (the coordinator)
        whether a change is pending."""
        with contextlib.suppress(dist.DistError):
            self._publish_desired()
            self._plan_out_lost(plan, step)
        change = False
        try:
            if self.signalled and not self._leave_sent and not self.hold.holds(plan):
                self.store.request_leave(self.node_id, step)
                self._leave_sent = True
            change = self._leave_sent
            if self.rank == 0:
                change = change or self.store.pending() != plan.pending
        except dist.DistError:
            pass
        return change

    def change(self, step: int) -> Plan | None:
        """Every rank, after boundary() agreed on a change: the coordinator plans the next
        generation; every node enters it, or leaves (returns None) when it is not in it."""
        self._follow_store(needed=True)
        if self.founded is not None:
            raise self._founded_error()
        assert self.plan is not None
        old = self.plan
        if self.rank == 0:
            pending = self.store.pending()
            seq, joining = self.store.joins_after(old.join_seq)
            req = Requests(step=step, leaving=self.store.leaving(
                               old.nodes + old.spares + tuple(joining)),
                           joining=tuple(joining), dead=self.heartbeat.dead_spares())
            self._advance(old, req, pending, seq)
        return self._follow(old, step)

    def _advance(self, old: Plan, req: Requests, pending: int, seq: int) -> None:
        if not self.store.try_advance(old.gen):
            return  # another would-be coordinator won; its plan is the one to follow
        try:
            if req.step < 0:  # only nodes without state (joiners) survived: start anew
                raise NoQuorumError(f"no live node of generation {old.gen} holds a step")
            plan = plan_generation(old, req, self._plan_config())
        except NoQuorumError:  # below the smallest world: the savers save, every node ends
            plan = plan_stop(old, req)
        self.store.publish(dataclasses.replace(plan, pending=pending, join_seq=seq))
        if old.gen >= 2:
            self.store.forget(old.gen - 1, old.nodes)

    def _follow(self, old: Plan, step: int) -> Plan | None:
        """Enter the plan after `old` (None: this node is not in it). When that generation
        fails before its group exists (a planned node went silent first), report `step` (the
        state this node holds) and follow the plan after that one, in this process."""
        failed = False
        while True:
            plan = self._wait_plan(old.gen + 1)
            # Only the spares changed, and the group is intact (after a failed collective,
            # `recover` released it: a plan with the same nodes then needs a new one).
            if (not failed and self.groups is not None and plan.nodes == old.nodes
                    and not plan.heal):
                self._keep(plan)
                return plan
            if self.resharder is not None and not failed and plan.reason != "stop":
                # On the old group, while it exists: a leaver's shards exist nowhere else.
                self.resharder.handover(old, plan, self.node_id)
            if self.node_id in plan.spares:
                # Set aside (the desired world shrank): wait as a spare, in this process, and
                # enter a later plan healed like any node that was not in the world before.
                self.generation.release()
                self.plan = None
                self.heartbeat.watch(plan.gen, ())
                return self._outside(functools.partial(self._await, plan.gen))
            alone = failed or self.groups is None  # the old group is gone (a failure)
            # After a failure this node saves the step alone, unless its model is sharded
            # (FSDP2: the shards of the lost nodes are gone; the checkpoint stays the newest).
            if (plan.reason == "stop" and self.node_id in plan.saving
                    and not (alone and self.resharder is not None)):
                if alone:
                    self.generation.alone()
                self.dissolving = True  # the group stays for the Session's last save
                self._stop_gen = plan.gen
                return None
            if plan.reason == "stop" or self.node_id not in plan.nodes:
                self._announce_rejoin(plan)
                if failed or plan.reason == "stop":
                    # Nothing of this node's to save (another saves the step, or the old group
                    # is gone): end as a dropped node does, to be restarted in place.
                    self.dropped = True
                if self.node_id in plan.saving:  # a sharded saver: nobody need wait for it
                    with contextlib.suppress(dist.DistError):
                        self.store.saved(plan.gen, self.node_id)
                regroup.destroy()
                self.plan = None
                self.heartbeat.stop()
                return None
            try:
                self._enter(plan)
                return plan
            except EntryFailedError as e:
                self._replan(plan, step, str(e))
                old, failed = plan, True

    def _announce_rejoin(self, plan: Plan) -> None:
        """Judged dead yet alive (thawed, or its partition lifted): tell the world, which
        watches its lost pods' announcements, that this pod restarts in place and rejoins, so
        the operator does not replace it meanwhile (heartbeat.Heartbeat, section 10)."""
        pod = pod_of(self.node_id)
        if pod in plan.lost:
            with contextlib.suppress(dist.DistError):
                self.store.announce_rejoin(pod, plan.gen)

    def _announce_rejoin_now(self) -> None:
        """The stuck watch's, on its own thread and connection (the training thread's client
        is its own): this process ends to be restarted in place. Announced at the store's
        current generation, as the world may have planned this pod out meanwhile."""
        with contextlib.suppress(Exception):
            store = self._connect(timedelta(seconds=2))
            store.announce_rejoin(pod_of(self.node_id), store.generation())

    def _replan(self, failed: Plan, step: int, error: str) -> None:
        """`failed`'s group never formed: mark it failed, report the state this node holds
        (-1: none, a joiner) and, as after a failed collective, let the first live node in
        plan order make the next plan."""
        self.store.mark_failed(failed.gen, self.node_id, error)
        self.store.report(failed.gen, self.node_id, step)
        self._plan_after_failure(failed)

    def adopt_groups(self, before: Iterable[int], group: dist.ProcessGroup | None = None) -> None:
        """The script (or a mesh) made `group` in this generation (`before`: socket_fds()
        before it did): its sockets are severed with the generation's, its listeners published
        for the peers, and on GPUs its NCCL communicators aborted with the generation's
        (inprocess.user_groups)."""
        if self.plan is not None:
            self.generation.adopt(self.plan.gen, before, group)

    # -- without notice --------------------------------------------------------------------
    def _sever(self, gen: int, store: MembershipStore) -> None:
        """The heartbeat thread's: generation `gen` failed. If this node's groups serve it, shut
        down their pairs (`inprocess.sever`): a collective blocked on a peer that went dark
        fails now, as on a killed peer, instead of at its timeout."""
        ended = self.generation.end_failed(gen, store.listeners)
        if ended is not None:
            emit("severed", node=self.node_id, gen=gen, **ended)
            self.stuck.severed(gen)  # the bound behind the sever (inprocess.stuck)

    def recover(self, step: int, error: str, model: nn.Module | None = None) -> Plan | None:
        """A collective of this generation failed (a peer is gone). Tear the group down at
        once, releasing `model`'s hold on it, so its sockets close and the other survivors'
        pending collectives fail too; report the committed step, and follow the plan the first
        live node in plan order makes once every node has reported or been judged dead by its
        heartbeat.

        Call it outside the `except` block that caught the failure: while the exception's
        traceback lives, the failed step's frames keep the group (and its sockets) alive, and a
        survivor blocked on this node waits for its collective timeout instead."""
        if self.plan is not None:
            self.stuck.released(self.plan.gen)
        self._follow_store(needed=True)
        if self.founded is not None:
            raise self._founded_error()
        assert self.plan is not None
        old = self.plan
        # Bounded, as every request after it is not: a store that answers nothing (its node
        # dark, and this node's heartbeat has not noticed: a node thawed after its world
        # moved to the store that replaced it) ends this node now as a lost store does
        # (StoreUnansweredError), instead of waiting on its socket until TCP gives up.
        self.client.bounded(lambda: self.store.mark_failed(old.gen, self.node_id, error),
                            2 * self.cfg.heartbeat_timeout_s)
        # A gloo side group may have failed first while NCCL kernels still wait on the lost
        # peer: abort them before the destroy, which would wait for them (inprocess.nccl).
        self.generation.abort(old.gen)
        self.release(model)
        if self.unhealed:  # lost during its own heal: it holds no step (a joiner's -1)
            step = -1
        self.store.report(old.gen, self.node_id, step)
        self._plan_after_failure(old)
        return self._follow(old, step)

    def _plan_after_failure(self, old: Plan) -> None:
        """Until a plan after `old` exists: once every node of `old` reported or is judged dead,
        the first live one in plan order makes it."""
        while not self.store.has_plan(old.gen + 1):
            reports = self.store.reports(old.gen, old.nodes)
            # The group failed: a node silent a few beats that never reported is gone (a
            # reporting node is judged by the full timeout, as before).
            dead = self.heartbeat.dead() | (self.heartbeat.silent() - set(reports))
            waiting = [n for n in old.nodes if n not in reports and n not in dead]
            order = successor_order(old, dead)
            if not waiting and order and order[0] == self.node_id:
                pending = self.store.pending()
                seq, joining = self.store.joins_after(old.join_seq)
                # A node that reported and died since (a second loss) is dead all the same.
                alive = {n: s for n, s in reports.items() if n not in dead}
                req = Requests(step=max(alive.values()),
                               dead=(frozenset(old.nodes) - set(alive)
                                     | self.heartbeat.dead_spares()),
                               leaving=self.store.leaving(old.nodes + old.spares
                                                          + tuple(joining)),
                               joining=tuple(joining), steps=alive)
                self._advance(old, req, pending, seq)
            time.sleep(0.02)

    def dissolve(self) -> None:
        """After a stop's last save (committed or failed): leave the old group for good, and
        say so, so the next start need not wait for this node's heartbeat to go silent."""
        self.generation.release()
        self.plan = None
        if self._stop_gen is not None:
            with contextlib.suppress(dist.DistError):  # the store away: judged by heartbeat
                self.store.saved(self._stop_gen, self.node_id)
        self.heartbeat.stop()

    def finish(self, step: int) -> None:
        """Training done: the coordinator tells waiting nodes; everyone stops beating."""
        if self.plan is not None and self.rank == 0:
            self.store.finish(step)
        self.heartbeat.stop()
