"""The job's store as a member follows it (docs/recovery.md section 7): the training thread's
client (inprocess.store_client), the store's incarnation this node knows, and following the
store again after it was lost, stopped answering or came back empty. A base of Member, under
Admission: both halves of a member use it.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import timedelta

import torch.distributed as dist

from elastrain_trainer.events import emit
from elastrain_trainer.inprocess.heartbeat import Heartbeat
from elastrain_trainer.inprocess.member_config import MemberConfig, StoreFoundedError
from elastrain_trainer.inprocess.membership import Epoch, Plan
from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.inprocess.store_client import TrainingClient


class StoreFollowing:
    """Its state is the Member's (set in Member.__init__)."""

    cfg: MemberConfig
    node_id: str
    client: TrainingClient
    heartbeat: Heartbeat
    epoch: Epoch | None
    founded: Epoch | None
    plan: Plan | None
    _reconnects: int
    _desired_sent: int | None

    @property
    def rank(self) -> int:
        raise NotImplementedError

    def _connect(self, connect_within: timedelta | None = None) -> MembershipStore:
        return MembershipStore.connect(self.cfg.store_host, self.cfg.store_port, self.cfg.run_id,
                                       connect_within=connect_within)

    @property
    def store(self) -> MembershipStore:
        """The training thread's client (StoreUnansweredError while it is given up)."""
        return self.client.store

    @store.setter
    def store(self, client: MembershipStore) -> None:
        self.client.replace(client)

    def _keep_claim(self) -> Epoch | None:
        """The claim this node makes on a store that came back empty: a node in a generation
        keeps it (its world restores into it); a node in none has nothing to restore."""
        return Epoch(True, self.node_id, uuid.uuid4().hex) if self.plan is not None else None

    def _founded_error(self) -> StoreFoundedError:
        return StoreFoundedError(self.founded.node if self.founded is not None else None)

    def _follow_store(self, needed: bool = False) -> None:
        """After the heartbeat thread reconnected to a lost store: this thread's client too.
        When the store came back empty (its epoch changed: section 7), it is kept by this
        world (the heartbeat thread's claim, or this one): the first of its nodes restores the
        current generation (its number and plan) and every node forgets the old store's
        counters, so the next leave or join is planned as before. Founded by a fresh node
        first: `founded`, and the world ends at this boundary (`boundary`). `needed`: a change
        needs the store now, so a store that answers again is followed before this node's
        heartbeat thread noticed it (a beat later: its peers may have followed already)."""
        away = self.client.away_since
        stale = (self.heartbeat.reconnects != self._reconnects
                 or (needed and (self.heartbeat.lost or away is not None))
                 or (away is not None and self.heartbeat.answered_after(away)))
        if not stale or not MembershipStore.reachable(self.cfg.store_host, self.cfg.store_port):
            return
        claim = self._keep_claim()
        assert claim is not None and self.plan is not None
        plan = dataclasses.replace(self.plan, pending=0, join_seq=0)
        try:  # a boundary waits on it: briefly (a store that accepts but does not answer)
            store, epoch = self.client.bounded(lambda: self._claim_with_new_client(claim, plan))
        except dist.DistError:
            return  # away again: the next boundary retries
        self._reconnects, self.store = self.heartbeat.reconnects, store
        if epoch != self.epoch:
            if not epoch.kept:
                self.founded = epoch
                emit("store_founded", node=self.node_id, by=epoch.node)
            self.epoch, self.plan = epoch, plan
            self._desired_sent = None  # the empty store forgot it: say it again

    def _claim_with_new_client(self, claim: Epoch, plan: Plan) -> tuple[MembershipStore, Epoch]:
        store = self._connect(self.heartbeat.beat)
        epoch = store.claim_epoch(claim)  # the heartbeat thread's claim, or this one
        # Any node of the world restores (the first one wins: store.restore): the coordinator
        # may be the node that went dark with the old store.
        if epoch != self.epoch and epoch.kept and store.restore(plan):
            emit("store_restored", node=self.node_id, gen=plan.gen, epoch=epoch.text())
        return store, epoch
