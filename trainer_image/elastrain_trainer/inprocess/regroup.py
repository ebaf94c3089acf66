"""Re-form the process group in the same process (docs/recovery.md section 4; gloo).

Destroy the default group (and with it the side groups), then init the next generation's on its
own store prefix, `gen/<g>/pg/`, so no key of an old generation is ever read again. A gloo group
with a dead peer tears down at once; closing our sockets is also what makes the other
survivors' pending collectives fail (section 8). NCCL (abort, not destroy) is documented in the
design and not implemented: `init_generation` refuses it.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]

from elastrain_trainer.parallel import Groups

# In-process mode's collective timeout (section 8): the backstop when neither a closed socket nor
# a heartbeat ends a blocked collective.
INPROCESS_COLLECTIVE_TIMEOUT = timedelta(seconds=30)


def destroy() -> None:
    """Leave the current generation (no-op when there is none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def init_generation(store: Store, rank: int, world_size: int, *,
                    backend: str = "gloo",
                    timeout: timedelta = INPROCESS_COLLECTIVE_TIMEOUT) -> Groups:
    """The default group of a generation on `store` (already its own prefix), then the
    Session's two gloo side groups, in the same order on every rank (new_group is collective)."""
    if backend != "gloo":
        raise ValueError(f"in-process recovery: backend {backend!r} is not implemented yet "
                         "(gloo only; NCCL needs abort + re-init, docs/recovery.md section 4)")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    checkpoint = dist.new_group(backend="gloo", timeout=timeout)
    assert isinstance(control, dist.ProcessGroup) and isinstance(checkpoint, dist.ProcessGroup)
    return Groups(control, checkpoint)
