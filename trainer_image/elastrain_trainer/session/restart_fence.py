"""Restart mode's checkpoint fence (docs/recovery.md section 8, "Fencing"): a worker whose group
was re-formed without it commits nothing.

torchrun restarts every worker whenever its group re-forms, so the generation of a Restart-mode
worker is its group's: rank 0 takes the next number from the job's rendezvous store (the store
pod, which outlives every worker) when the group forms, beside the store's incarnation (an
epoch claim, as in-process mode's). A worker that froze or was cut off while its coordinator
held a save whose shards were all written wakes into a job whose agents have formed a newer
group without it; asked right before the commit, the store names that newer generation and the
commit is refused (`checkpoint_fenced`), so it neither commits nor moves `latest`. A legitimate
save is never refused: DCP's peers wait in the save for the coordinator's commit, so no group
can re-form around a live commit. When the store cannot answer, the commit goes ahead with its
generation recorded and the bucket's rule (checkpoint/catalog.py) fences it if it was stale, as
in in-process mode.

Generations are numbered by the store, and a replaced store starts again from 1, so markers
carry a lineage, not the store's incarnation: the first group on a store founds the store's
lineage from the bucket (the lineage and highest generation of the run's newest commit or
generation record, `found`) and numbers its group above it, and each group's coordinator
records the generation it entered (manager.mark_generation). A coordinator cut off together
with the old store (which still vouches for it) is then refused by the bucket: a newer
generation of its own lineage began there (catalog.outrun_by). Before, its commit carried the
old store's incarnation, which no marker of the new store's groups shared, so nothing compared
them.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

from elastrain_trainer.inprocess import membership as m
from elastrain_trainer.inprocess.fence import FencedError
from elastrain_trainer.inprocess.store import MembershipStore

# Keys live under elastrain/restart/ of the rendezvous store (torchrun's own are under
# torch.rendezvous.*): one counter and one epoch claim per job, whatever its run id.
STORE_RUN = "restart"
LINEAGE_KEY = "lineage"  # the line of generations this store's groups continue (`found`)


def claim_generation(store: MembershipStore, node: str) -> tuple[str, int]:
    """The store's incarnation (the first claim wins) and the next group's generation."""
    epoch = store.claim_epoch(m.Epoch(kept=False, node=node or "worker", nonce=uuid.uuid4().hex))
    return epoch.text(), int(store.kv.add(m.GEN_KEY, 1))


class RestartFence:
    """`connect()`: a new client of the job's store under STORE_RUN (the fence's own: it runs
    on the upload thread). `epoch`, `gen`: this group's, from claim_generation."""

    def __init__(self, connect: Callable[[], MembershipStore], epoch: str, gen: int) -> None:
        self._connect, self.epoch, self.gen = connect, epoch, gen
        self.lineage = epoch  # until `found` reads the store's
        self._store: MembershipStore | None = None
        self._lock = threading.Lock()

    def found(self, newest: Callable[[], tuple[str, int] | None]) -> tuple[str, int]:
        """(lineage, generation) of this group, rank 0 once its checkpoint root is known:
        the store's lineage, founded by its first group from `newest()` (the bucket's
        catalog.line_of: None, none yet) and this group renumbered above that line's highest
        generation. A bucket that cannot be read (`newest` raises) founds nothing: this group
        keeps its store's incarnation as its lineage, as before, and the next group tries
        again."""
        with self._lock:
            store = self._store or self._connect()
            key = store.kv  # elastrain/restart/ of the job's store
            have = bytes(key.get(LINEAGE_KEY)).decode() if key.check([LINEAGE_KEY]) else ""
            if not have:
                line = newest()
                candidate = line[0] if line is not None else self.epoch
                have = bytes(key.compare_set(LINEAGE_KEY, "", candidate)).decode()
                if have == candidate and line is not None and line[1] >= self.gen:
                    # This group is the store's first: its number follows the line's.
                    self.gen = int(key.add(m.GEN_KEY, line[1] + 1 - store.generation()))
            # A client that answered: the fence's commits reuse it (as __call__ keeps its own).
            self._store, self.lineage = store, have
            return self.lineage, self.gen

    def __call__(self) -> tuple[str, int]:
        """(lineage, generation) for the commit's marker; FencedError refuses the commit."""
        with self._lock:
            try:
                self._store = self._store or self._connect()
                epoch, current = self._store.epoch(), self._store.generation()
            except Exception:
                self._store = None  # a new client next time
                return self.lineage, self.gen
        if epoch is not None and epoch.text() != self.epoch:
            raise FencedError(f"the job's store was replaced ({epoch.text()}, this group's "
                              f"{self.epoch}): a newer worker group owns the job")
        if current > self.gen:
            raise FencedError(f"re-formed without this worker: generation {current} is the "
                              f"worker group's, this worker's is {self.gen}")
        return self.lineage, self.gen
