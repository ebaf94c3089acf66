"""Before a node is in the world (docs/recovery.md sections 2, 7 and 9): it registers, meets the
store's incarnation, asks to join and waits, as a joiner or a spare, for a plan that names it;
the node that finds no live generation plans a start one. `Member` is this and what a node in
the world does (inprocess.member).
"""

from __future__ import annotations

import dataclasses
import time
import uuid

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
        plans keep beyond the world waits here as a spare (section 9)."""
        self.store.register(self.node_id, {"nproc": self.cfg.plan.ranks_per_node,
                                           "started": time.time()})
        self.heartbeat.start()
        self.epoch = self._meet_store()
        gen = self.store.generation()
        self._join_seq = self.store.request_join(self.node_id)
        fault_injection.after_join_request()
        if gen == 0 and not self.epoch.kept and self.store.try_advance(0):
            self._publish_start(None)
        # `gen` is won before its plan is published, so the plan of the generation read may
        # still name this node: look from there on.
        return self._await(max(gen, 1))

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
        epoch = self.store.epoch()
        while epoch is None and time.monotonic() < deadline:
            time.sleep(0.05)
            epoch = self.store.epoch()
        if epoch is None:
            epoch = self.store.claim_epoch(Epoch(False, self.node_id, uuid.uuid4().hex))
        liveness = Liveness(self.cfg.heartbeat_timeout_s)
        deadline = time.monotonic() + self.cfg.plan_wait_s
        waited = False
        while epoch.kept and self.store.generation() == 0:
            if not waited:
                waited = True
                emit("store_kept", node=self.node_id, by=epoch.node)
            if self.signalled:
                self._leave_waiting()
            now = time.monotonic()
            liveness.observe(self.store.heartbeats([epoch.node]), now)
            if epoch.node in liveness.dead(now):  # its world is gone too: nothing to restore
                epoch = self.store.replace_epoch(epoch, Epoch(False, self.node_id,
                                                              uuid.uuid4().hex))
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
        one; when every node of the newest plan is silent, this node starts the next."""
        liveness = Liveness(self.cfg.heartbeat_timeout_s)
        deadline = time.monotonic() + self.cfg.plan_wait_s
        role = ""
        while True:
            if self.signalled:
                self._leave_waiting()
            self._publish_desired()
            if self.store.has_plan(gen + 1):
                gen += 1
                continue
            if self.store.done():
                raise SystemExit(0)  # training finished while this node waited
            plan = self.store.read_plan(gen) if self.store.has_plan(gen) else None
            if plan is None:
                if time.monotonic() > deadline:
                    raise PlanTimeoutError(f"{self.node_id}: no plan for generation {gen} "
                                           f"within {self.cfg.plan_wait_s} s")
            elif self.node_id in plan.nodes:
                try:
                    self._enter(plan)
                    return plan
                except EntryFailedError as e:  # a joiner holds no state: healed in the next
                    self._replan(plan, -1, str(e))
                    deadline = time.monotonic() + self.cfg.plan_wait_s
            else:
                if self.node_id in plan.spares and role != "spare":
                    role = "spare"
                    self.cfg.on_role(role)
                    emit("spare", node=self.node_id, gen=plan.gen, world_size=plan.world_size)
                elif (self.node_id not in plan.spares and plan.join_seq >= self._join_seq
                      and plan.reason != "stop"):
                    self._join_seq = self.store.request_join(self.node_id)
                # After a stop, its old group's nodes are still saving: start once each has
                # saved or is silent (the pod's grace period bounds the save).
                watched = set(plan.nodes) | (set(plan.saving)
                                             - self.store.saved_by(gen, plan.saving))
                now = time.monotonic()
                liveness.observe(self.store.heartbeats(watched), now)
                if liveness.dead(now) >= watched and self.store.try_advance(gen):
                    self._publish_start(plan)
            time.sleep(0.05)

    def _leave_waiting(self) -> None:
        """A SIGTERM to a node outside the world (a spare, a joiner): it asks to leave, so the
        next plan drops it, and exits 0 (no state of the job's is only here)."""
        self.store.request_leave(self.node_id, -1)
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
        self.store.publish(dataclasses.replace(plan, gen=gen, pending=pending, join_seq=seq))

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
