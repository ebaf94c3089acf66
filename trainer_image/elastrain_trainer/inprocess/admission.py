"""Before a node is in the world (docs/recovery.md sections 2, 7 and 9): it registers, meets the
store's incarnation, asks to join and waits, as a joiner or a spare, for a plan that names it;
the node that finds no live generation plans a start one. `Member` is this and what a node in
the world does (inprocess.member).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from elastrain_trainer import fault_injection
from elastrain_trainer.events import emit
from elastrain_trainer.inprocess.following import StoreFollowing
from elastrain_trainer.inprocess.member_config import (
    EntryFailedError,
    PlanTimeoutError,
)
from elastrain_trainer.inprocess.membership import (
    Epoch,
    Liveness,
    NoQuorumError,
    Plan,
    PlanConfig,
    Requests,
    plan_generation,
    pod_of,
)

T = TypeVar("T")
# How long a node outside the world waits for a store that is lost or answers nothing before
# it ends as on a lost rendezvous (EXIT_STORE_LOST): the operator replaces a store whose node
# was lost once the node controller marks it (~50 s on the two e2e nodes), so minutes.
STORE_AWAY_S = 300.0


@dataclasses.dataclass
class _Waiting:
    """What `_await` carries from one look to the next."""

    gen: int
    liveness: Liveness
    deadline: float
    join_seq: int
    role: str = ""


class Admission(StoreFollowing):
    """The waiting half of a Member: its state is the Member's (set in Member.__init__)."""

    signalled: bool
    _join_seq: int
    _desired_sent: int | None
    _lost_sent: set[str]

    def _enter(self, plan: Plan) -> None:
        raise NotImplementedError

    def _replan(self, failed: Plan, step: int, error: str) -> None:
        raise NotImplementedError

    def join(self) -> Plan:
        """Register, ask to join, and enter the first plan that includes this node. The first
        node of a job coordinates the start generation (every node that came in time); a node
        that finds no live generation (every node of the newest plan silent for the heartbeat
        timeout: a drain, or every survivor restarted in place) coordinates a new start
        generation, which loads the newest checkpoint as the job's first one does. A node the
        plans keep beyond the world waits here as a spare (section 9), through the store's
        loss (`_outside`)."""
        return self._outside(self._ask_to_join)

    def _ask_to_join(self) -> Plan:
        self._ask(lambda: self.store.register(self.node_id, {
            "nproc": self.cfg.plan.ranks_per_node, "started": time.time()}))
        if not self.heartbeat.started:
            self.heartbeat.start()
        self.epoch = self._meet_store()
        gen = self._ask(self.store.generation)
        self._join_seq = self._ask(lambda: self.store.request_join(self.node_id))
        fault_injection.after_join_request()
        if gen == 0 and not self.epoch.kept and self._ask(lambda: self.store.try_advance(0)):
            self._publish_start(None)
        # `gen` is won before its plan is published, so the plan of the generation read may
        # still name this node: look from there on.
        return self._await(max(gen, 1))

    def _ask(self, fn: Callable[[], T]) -> T:
        """A request of a node outside the world, waited for at most twice the heartbeat
        timeout (inprocess.store_client): such a node is in no hurry, but one whose store went
        dark would wait on its socket until TCP gives up (~15 minutes), a spare that reads as
        ready while it can take no place (seen in e2e scenario 5)."""
        return self.client.bounded(fn, 2 * self.cfg.heartbeat_timeout_s)

    def _outside(self, wait: Callable[[], Plan]) -> Plan:
        """`wait` for a plan that names this node in its world, followed through the loss of
        the store: as the world trains on without it (section 7), a node outside the world
        waits for the store to answer again (its heartbeat thread probes and reconnects) and
        asks to join the store it finds, which the world restored into or a node founded,
        instead of ending its process (torch imported, the model built: a spare's whole
        point). A store that does not answer for STORE_AWAY_S ends it as before."""
        while True:
            try:
                return wait()
            except dist.DistError as e:
                if self.plan is not None:
                    raise  # entered, then lost: a member's path
                self._store_back_outside(e)
                wait = self._ask_to_join

    def _store_back_outside(self, error: dist.DistError) -> None:
        away, reconnects = time.monotonic(), self.heartbeat.reconnects
        emit("store_away_waiting", node=self.node_id,
             error=f"{type(error).__name__}: {' '.join(str(error).split())[:200]}")
        while time.monotonic() - away < STORE_AWAY_S:
            if self.signalled:
                self.heartbeat.stop()  # nothing to ask of a store that is away: its silence
                emit("left", node=self.node_id, step=-1, waiting=True)  # drops it from plans
                raise SystemExit(0)
            if self.heartbeat.reconnects != reconnects or self.heartbeat.answered_after(away):
                with contextlib.suppress(dist.DistError):
                    self.store = self._ask(lambda: self._connect(self.heartbeat.beat))
                    emit("store_followed", node=self.node_id, waiting=True,
                         away_s=round(time.monotonic() - away, 2))
                    return
            time.sleep(self.heartbeat.interval_s)
        raise error

    def _meet_store(self) -> Epoch:
        """The store's incarnation, as a node that holds no generation meets it (section 7).
        An unclaimed store is the job's first, or one that came back empty while a world
        trains on without it; that world's nodes claim it within a beat of reconnecting
        (their heartbeat threads probe it every beat), so this node waits the heartbeat
        timeout for such a claim before it founds the store. Whatever the timing, a store has
        one claim: a world that finds its store founded by another node ends instead of
        restoring. A kept store is waited on until its world restored the generation (at its
        next step boundary), unless the node that kept it falls silent first."""
        deadline = time.monotonic() + self.cfg.heartbeat_timeout_s
        epoch = self._ask(self.store.epoch)
        while epoch is None and time.monotonic() < deadline:
            time.sleep(0.05)
            epoch = self._ask(self.store.epoch)
        if epoch is None:
            claim = Epoch(False, self.node_id, uuid.uuid4().hex)
            epoch = self._ask(lambda: self.store.claim_epoch(claim))
        liveness = Liveness(self.cfg.heartbeat_timeout_s)
        deadline = time.monotonic() + self.cfg.plan_wait_s
        waited = False
        while epoch.kept and self._ask(self.store.generation) == 0:
            if not waited:
                waited = True
                emit("store_kept", node=self.node_id, by=epoch.node)
            if self.signalled:
                self._leave_waiting()
            now = time.monotonic()
            liveness.observe(self._ask(functools.partial(self.store.heartbeats, [epoch.node])),
                             now)
            if epoch.node in liveness.dead(now):  # its world is gone too: nothing to restore
                epoch = self._ask(functools.partial(self.store.replace_epoch, epoch, Epoch(
                    False, self.node_id, uuid.uuid4().hex)))
            elif now > deadline:
                raise PlanTimeoutError(f"{self.node_id}: the store kept by {epoch.node} was "
                                       f"not restored within {self.cfg.plan_wait_s} s")
            time.sleep(0.05)
        return epoch

    def _await(self, gen: int) -> Plan:
        """Wait from generation `gen` on for a plan that names this node in its world, and
        enter it. Meanwhile: a SIGTERM ends the wait (the node asks to leave and exits 0, as a
        joiner does when training finished); a plan that read this node's join request but
        names it nowhere (a spare judged dead, a start after a dead generation) gets a new
        one; when every node of the newest plan is silent, this node starts the next. Each
        look at the store is bounded (`_ask`)."""
        w = _Waiting(gen, Liveness(self.cfg.heartbeat_timeout_s),
                     time.monotonic() + self.cfg.plan_wait_s, self._join_seq)
        while True:
            if self.signalled:
                self._leave_waiting()
            found = self._ask(lambda: self._look(w))
            self._join_seq = w.join_seq
            if isinstance(found, Plan):
                try:
                    self._enter(found)
                    return found
                except EntryFailedError as e:  # a joiner holds no state: healed in the next
                    self._replan(found, -1, str(e))
                    w.deadline = time.monotonic() + self.cfg.plan_wait_s
            elif found is not None:
                self._publish_start(found[0])
            time.sleep(0.05)

    def _look(self, w: _Waiting) -> Plan | tuple[Plan] | None:
        """One look of `_await` (on the bounded calls' worker, so it changes only `w`): the
        plan to enter, (the dead plan,) when this node is to start the generation after it,
        else None."""
        self._publish_desired()
        while self.store.has_plan(w.gen + 1):
            w.gen += 1
        if self.store.done():
            raise SystemExit(0)  # training finished while this node waited
        plan = self.store.read_plan(w.gen) if self.store.has_plan(w.gen) else None
        if plan is None:
            if time.monotonic() > w.deadline:
                raise PlanTimeoutError(f"{self.node_id}: no plan for generation {w.gen} "
                                       f"within {self.cfg.plan_wait_s} s")
            return None
        if self.node_id in plan.nodes:
            return plan
        if self.node_id in plan.spares and w.role != "spare":
            w.role = "spare"
            if self.client.current():
                self.cfg.on_role(w.role)
                emit("spare", node=self.node_id, gen=plan.gen, world_size=plan.world_size)
        elif (self.node_id not in plan.spares and plan.join_seq >= w.join_seq
              and plan.reason != "stop"):
            w.join_seq = self.store.request_join(self.node_id)
        # After a stop, its old group's nodes are still saving: start once each has saved or
        # is silent (the pod's grace period bounds the save).
        watched = set(plan.nodes) | (set(plan.saving) - self.store.saved_by(w.gen, plan.saving))
        now = time.monotonic()
        w.liveness.observe(self.store.heartbeats(watched), now)
        if w.liveness.dead(now) >= watched and self.store.try_advance(w.gen):
            return (plan,)
        return None

    def _leave_waiting(self) -> None:
        """A SIGTERM to a node outside the world (a spare, a joiner): it asks to leave, so the
        next plan drops it, and exits 0 (no state of the job's is only here). A store away
        is not waited for: the node's silence drops it as well."""
        with contextlib.suppress(dist.DistError):
            self._ask(lambda: self.store.request_leave(self.node_id, -1))
        self.heartbeat.stop()
        emit("left", node=self.node_id, step=-1, waiting=True)
        raise SystemExit(0)

    def _publish_desired(self) -> None:
        """With spares: the desired world this node heard from the operator reaches the store
        (and, by the `pending` bump, the coordinator), once per new value."""
        heard = self.cfg.desired() if self.cfg.spares else None
        if heard is None or heard == self._desired_sent:
            return
        known = self.store.desired()
        if known is None and heard == self.cfg.expected:
            self.store.record_desired(heard)  # what plans assume already: no replan
        elif known != heard:
            self.store.request_desired(heard)
        self._desired_sent = heard

    def _plan_out_lost(self, plan: Plan, step: int) -> None:
        """The nodes of `plan` whose pods the operator says are on a lost node (NotReady or
        unreachable: a kubelet and container runtime that stopped leave their containers
        running) leave the world at this boundary: a leave asked on their behalf, once each,
        as their own SIGTERM would. Such a node still takes part in the boundary's agreement,
        finds itself out of the next plan and ends (exit 0), before the operator replaces its
        pod (issue 34 item 4); one that went dark is the heartbeat's already."""
        lost = self.cfg.lost()
        for node in (plan.nodes + plan.spares) if lost else ():
            if node not in self._lost_sent and pod_of(node) in lost:
                self.store.request_leave(node, step)
                self._lost_sent.add(node)
                emit("lost_node_leave", node=self.node_id, leaver=node, step=step)

    def _plan_config(self) -> PlanConfig:
        """The bounds of the next plan: with spares, the world is at most the desired one."""
        base = self.cfg.plan
        if not self.cfg.spares:
            return base
        desired = self.store.desired() or self.cfg.expected
        return dataclasses.replace(base, max_world=max(base.min_world,
                                                       min(base.max_world, desired)))

    def _publish_start(self, dead: Plan | None) -> None:
        """The plan of a start generation after `dead` (None: the job's first): the nodes that
        asked to join since `dead`'s plan and still beat, once `expected` asked or the wait is
        over (after `dead`, a heartbeat timeout at most: replacements that come later join
        the live generation), and at least as many as the smallest world."""
        after = dead.join_seq if dead is not None else 0
        wait = self.cfg.start_wait_s if dead is None else self.cfg.heartbeat_timeout_s
        deadline = time.monotonic() + wait
        while True:
            while (self.store.joins_after(after)[0] - after
                   < self.cfg.expected * self.cfg.plan.ranks_per_node
                   and time.monotonic() < deadline):
                time.sleep(0.02)
            pending = self.store.pending()
            seq, joining = self.store.joins_after(after)
            if dead is not None:
                joining = self._beating(joining)
            try:
                plan = plan_generation(None, Requests(step=0, joining=tuple(joining)),
                                       self._plan_config())
                break
            except NoQuorumError:  # too few nodes yet for the smallest world: wait for more
                time.sleep(0.1)
        gen = dead.gen + 1 if dead is not None else 1
        # A start after a dead plan goes on with that plan's lineage (its store was kept, or it
        # would hold no plan); the job's first founds one with this store's incarnation.
        lineage = (dead.lineage if dead is not None and dead.lineage
                   else self.epoch.text() if self.epoch is not None else "")
        self.store.publish(dataclasses.replace(plan, gen=gen, pending=pending, join_seq=seq,
                                               lineage=lineage))

    def _beating(self, nodes: list[str]) -> list[str]:
        """The `nodes` whose heartbeat counter moves (a join request outlives its node)."""
        first = self.store.heartbeats(nodes)
        time.sleep(self.heartbeat.timeout_s / 2)
        then = self.store.heartbeats(nodes)
        return [n for n in nodes if n == self.node_id or then[n] != first[n]]

    def _wait_plan(self, gen: int) -> Plan:
        deadline = time.monotonic() + self.cfg.plan_wait_s
        while time.monotonic() < deadline:
            plan = self.store.wait_plan(gen, timeout_s=1.0)
            if plan is not None:
                return plan
            if self.store.done():
                raise SystemExit(0)  # training finished while this node waited
        raise PlanTimeoutError(f"{self.node_id}: no plan for generation {gen} within "
                               f"{self.cfg.plan_wait_s} s")
