"""The bucket's side of fencing (catalog.py's module docstring, docs/recovery.md section 8):
what a commit checks in the bucket before its marker (`check_not_outrun`), and the record a
world's coordinator writes as it enters a generation (`record_generation`). The store's side
is the fence the manager is given (inprocess.fence, session.restart_fence)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from elastrain_trainer.checkpoint import catalog as cat
from elastrain_trainer.checkpoint import manifest as mf
from elastrain_trainer.checkpoint.dcp_io import short_error
from elastrain_trainer.checkpoint.root import scan
from elastrain_trainer.checkpoint.storage import CheckpointStorage, join
from elastrain_trainer.events import emit

# Called on the coordinator right before a commit: (lineage, generation) of the world that
# makes it, recorded in its marker (catalog.py compares them); an exception says why this
# process may not commit (the world moved on without it) and refuses the commit.
Fence = Callable[[], tuple[str, int]]


class CommitFencedError(RuntimeError):
    """A newer generation of this writer's lineage has committed (or begun): the world moved on
    without this node, and what it saved must not be committed."""


def check_not_outrun(storage: CheckpointStorage, known: cat.Catalog | None, run: str,
                     lineage: str, gen: int) -> None:
    """The store's answer can come from the wrong store: one replaced while this node was cut
    off with it still answers for the generation it knew (e2e scenario 6). The bucket is the
    one place both sides write, so a newer generation's commit or record there refuses this
    commit. A root that cannot be listed lets it through (the store's rule for a lost store: a
    world must keep committing); the catalog fences it on read if it was stale. One LIST per
    commit, and only the markers `known` lacks: a root that keeps a hundred commits costs no
    hundred reads on every commit."""
    if gen <= 0:
        return
    try:
        newer = cat.outrun_by(scan(storage, known=known), run, lineage, gen)
    except Exception as e:  # a flaky store; the read-side rule still holds
        emit("checkpoint_fence_unchecked", error=short_error(e))
        return
    if newer is not None:
        done = "began" if newer.step < 0 else "committed"
        raise CommitFencedError(f"planned out: generation {newer.gen} of this lineage "
                                f"{done} ({newer.dir}); this node's is {gen}")


def record_generation(storage: CheckpointStorage, known: cat.Catalog | None, run: str,
                      lineage: str, gen: int, next_seq: int) -> threading.Thread | None:
    """Write, in the background, that `run`'s `lineage` entered generation `gen`, with the
    sequence number its next commit gets (`next_seq` or above): a node the world planned out,
    whose old store still vouches for it, is then refused before the world's first commit in
    `gen` exists. A record that cannot be written is told; the commits still fence from the
    world's first commit on."""
    if gen <= 0:
        return None

    def write() -> None:
        try:
            seq = max(next_seq, scan(storage, known=known).next_seq())
            key = mf.generation_record_key(run, lineage, gen)
            storage.write(key, mf.build_generation_record(run, lineage, gen, seq))
        except Exception as e:
            emit("generation_record_failed", gen=gen, error=short_error(e))
        else:
            emit("generation_recorded", gen=gen, seq=seq, uri=join(storage.uri, key))

    thread = threading.Thread(target=write, name="elastrain-generation-record", daemon=True)
    thread.start()
    return thread
