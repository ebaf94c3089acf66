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


def claim_generation(store: MembershipStore, node: str) -> tuple[str, int]:
    """The store's incarnation (the first claim wins) and the next group's generation."""
    epoch = store.claim_epoch(m.Epoch(kept=False, node=node or "worker", nonce=uuid.uuid4().hex))
    return epoch.text(), int(store.kv.add(m.GEN_KEY, 1))


class RestartFence:
    """`connect()`: a new client of the job's store under STORE_RUN (the fence's own: it runs
    on the upload thread). `epoch`, `gen`: this group's, from claim_generation."""

    def __init__(self, connect: Callable[[], MembershipStore], epoch: str, gen: int) -> None:
        self._connect, self.epoch, self.gen = connect, epoch, gen
        self._store: MembershipStore | None = None
        self._lock = threading.Lock()

    def __call__(self) -> tuple[str, int]:
        """(store epoch, generation) for the commit's marker; FencedError refuses the commit."""
        with self._lock:
            try:
                self._store = self._store or self._connect()
                epoch, current = self._store.epoch(), self._store.generation()
            except Exception:
                self._store = None  # a new client next time
                return self.epoch, self.gen
        if epoch is not None and epoch.text() != self.epoch:
            raise FencedError(f"the job's store was replaced ({epoch.text()}, this group's "
                              f"{self.epoch}): a newer worker group owns the job")
        if current > self.gen:
            raise FencedError(f"re-formed without this worker: generation {current} is the "
                              f"worker group's, this worker's is {self.gen}")
        return self.epoch, self.gen
