"""Re-form the process group in the same process (docs/recovery.md section 4).

Destroy the default group (and with it the side groups), then init the next generation's on its
own store prefix, `gen/<g>/pg/`, so no key of an old generation is ever read again. A gloo group
with a dead peer tears down at once; closing our sockets is also what makes the other
survivors' pending collectives fail (section 8). On GPUs the default group is NCCL's for CUDA
tensors, bound to the rank's device, and a failed one is aborted first (inprocess.nccl).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import HashStore, Store  # type: ignore[attr-defined]

from elastrain_trainer.inprocess import nccl
from elastrain_trainer.parallel import COLLECTIVE_TIMEOUT, Groups

# In-process mode's collective timeout (section 8): the backstop when neither a closed socket nor
# the heartbeat (which severs a failed generation's sockets, inprocess.sever) ends a blocked
# collective: only when the store is lost too. As long as Restart mode's, so that a slow step
# (a peer 10x slower than usual, a long stall) is never taken for a lost peer: the heartbeat,
# which beats from its own thread, is the only detector of a silent one.
INPROCESS_COLLECTIVE_TIMEOUT = COLLECTIVE_TIMEOUT
# How long a generation's nodes wait for each other to arrive (`Member._arrive`), and a start
# generation's groups to form: a node that beats but never comes.
ARRIVAL_TIMEOUT = timedelta(seconds=30)
# The checkpoint group's: DCP's collectives there wait for the slowest rank's uploads and for
# the coordinator's metadata and commit, which a slow object store stretches well past 30 s. A
# save blocked on a peer that went dark ends when the heartbeat severs its sockets, as any
# collective of the generation.
CHECKPOINT_COLLECTIVE_TIMEOUT = COLLECTIVE_TIMEOUT
# The bound on forming a generation's groups once every planned node arrived (section 13, point
# 18). gloo's rendezvous waits this long for a node lost inside it (killed, or frozen after it
# arrived) before the init fails and the survivors plan the next generation without it, in
# process. Generous for the init itself, which takes well under a second once all arrived.
ENTRY_INIT_TIMEOUT = timedelta(seconds=10)


def destroy() -> None:
    """Leave the current generation, if any, so that the next one's groups are named as on
    every other rank. c10d names a group by a per-process counter that only the default
    group's destroy resets; an init that failed (a planned peer never came) counted its group
    but left no default group to destroy, and this process's every later generation would
    look for its peers under another name than theirs (seen: all three nodes of a world
    failing every generation after one node bailed out of an init the other two had begun).
    A private world of one, made and destroyed, resets it with public calls only."""
    if not dist.is_initialized():
        if dist.get_pg_count() == 0:
            return
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()


def init_generation(store: Store, rank: int, world_size: int, *,
                    device: torch.device | None = None,
                    timeout: timedelta = INPROCESS_COLLECTIVE_TIMEOUT,
                    init_timeout: timedelta | None = None) -> Groups:
    """The default group of a generation on `store` (already its own prefix), then the
    Session's two gloo side groups, in the same order on every rank (new_group is collective);
    the checkpoint group waits at least CHECKPOINT_COLLECTIVE_TIMEOUT. `init_timeout` bounds
    the forming of the three groups (each rendezvous waits that long for a missing rank: a
    DistError); their collectives then wait `timeout`. A CUDA `device`: the default group is
    NCCL's for CUDA tensors, its communicators made at init on that device (inprocess.nccl)."""
    backend = nccl.backend_for(device) if device is not None else nccl.GLOO
    forming = init_timeout or timeout
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=forming,
                            device_id=device if nccl.is_device_backend(backend) else None)
    control = dist.new_group(backend="gloo", timeout=forming)
    checkpoint = dist.new_group(backend="gloo", timeout=forming)
    assert isinstance(control, dist.ProcessGroup) and isinstance(checkpoint, dist.ProcessGroup)
    dist.set_timeout(timeout)
    dist.set_timeout(timeout, control)
    dist.set_timeout(max(timeout, CHECKPOINT_COLLECTIVE_TIMEOUT), checkpoint)
    return Groups(control, checkpoint)
