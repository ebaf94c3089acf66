"""The checkpoint's fence in in-process mode (docs/recovery.md section 8, "Fencing"): a node
planned out of the world commits nothing.

A node that froze or was cut off while the others planned it out can wake with a save whose
shards were all written before it froze: only its commit is left, and nothing in the bucket
would stop it (no compare-and-set), so its coordinator would commit an old step and move
`latest` back under the world that went on. CheckpointManager calls the fence on the
coordinator right before a commit: it asks the job's store which generation is current. A save
never spans two generations (session.world waits for it before every change), so a commit made
in the current generation is the world's; once `gen` has moved past this node's generation, the
commit is refused, unless the current generation is a stop whose save this node makes (too few
nodes remained: the old group's nodes save its step, section 8).

When the store cannot answer, the commit goes ahead: training goes on while the store is lost
(section 7), and a world whose store is away for minutes must keep committing, or a later loss
costs all of it (seen: a refusing fence left a world that trained through a store's loss with
nothing to resume from). Such a commit still records its generation, so the bucket's rule
(checkpoint/catalog.py) fences it if it turns out stale.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

from elastrain_trainer.inprocess.membership import Epoch, Plan
from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.inprocess.store_client import BoundedCalls

# A commit waits at most this long for the store's answer (a connect, then one read).
ANSWER_WITHIN = timedelta(seconds=5)


class FencedError(RuntimeError):
    """This node's world moved on without it: what it saved must not be committed."""


class StoreFence:
    """`connect(connect_within)`: a new client of the job's store (the fence's own: it runs on
    the upload thread, beside the training thread's and the heartbeat's clients).
    `current()`: the store incarnation, the plan this node is in now, and the stop generation
    whose save it makes (None: none). `store_lost()`: the heartbeat lost the store (then the
    fence does not wait on it)."""

    def __init__(self, connect: Callable[[timedelta | None], MembershipStore],
                 current: Callable[[], tuple[Epoch | None, Plan | None, int | None]],
                 store_lost: Callable[[], bool] = lambda: False) -> None:
        self._connect, self._current, self._store_lost = connect, current, store_lost
        self._store: MembershipStore | None = None
        self._lock = threading.Lock()
        # A store that accepts but does not answer (frozen, or its node dark) would hold the
        # commit, and every later one, for as long as TCP keeps the connection.
        self._calls = BoundedCalls(ANSWER_WITHIN.total_seconds(), "elastrain-fence-store")

    def _generation(self) -> int:
        store = self._store
        if store is None:
            store = self._connect(ANSWER_WITHIN)
            store.raw.set_timeout(ANSWER_WITHIN)
        if self._calls.on_current_worker():
            self._store = store
        return store.generation()

    def identity(self) -> tuple[str, int] | None:
        """(lineage, generation) of the plan this node is in now; None: none."""
        epoch, plan, _ = self._current()
        return _identity(epoch, plan)

    def __call__(self) -> tuple[str, int]:
        """(lineage, generation) for the commit's marker; FencedError refuses the commit."""
        epoch, plan, stop_gen = self._current()  # one snapshot: the plan may change meanwhile
        mine = _identity(epoch, plan)
        if plan is None or mine is None:
            raise FencedError("this node is in no generation")
        if self._store_lost():
            return mine
        with self._lock:
            try:
                current = self._calls.call(self._generation)
            except Exception:
                self._store = None  # a new client next time
                return mine
        if current > plan.gen and current != stop_gen:
            raise FencedError(f"planned out: generation {current} is the world's, this node's "
                              f"is {plan.gen}")
        return mine


def _identity(epoch: Epoch | None, plan: Plan | None) -> tuple[str, int] | None:
    if plan is None:
        return None
    # The lineage, not the store it was made in: generations compare across stores that were
    # replaced and restored (a node dark with its old store commits into another's).
    return plan.lineage or (epoch.text() if epoch is not None else ""), plan.gen
