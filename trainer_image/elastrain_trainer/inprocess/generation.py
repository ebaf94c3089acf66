"""The process groups of the generation a node is in (docs/recovery.md sections 4 and 8).

inprocess.member runs the protocol (plans, heals, changes); this owns what a generation forms
and tears down: its groups, made on the generation's store prefix; what the heartbeat thread
ends when the generation fails (the gloo pairs it severs, on GPUs the NCCL communicators it
aborts, inprocess.sever and inprocess.nccl); and their release at a change.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import HashStore, Store  # type: ignore[attr-defined]
from torch.nn.parallel import DistributedDataParallel as DDP

from elastrain_trainer.inprocess import nccl, regroup, rewrap, sever
from elastrain_trainer.parallel import Groups


class Generation:
    def __init__(self, node_id: str, publish: Callable[[int, str, str], None],
                 device: torch.device | None) -> None:
        self.node_id, self.device = node_id, device
        self.groups: Groups | None = None
        # The sockets of the groups in use and the generations they serve (kept plans reuse
        # them): what the heartbeat thread severs when one of those generations fails.
        self._held = sever.Held(node_id, publish)
        # On GPUs, their NCCL groups too: aborted with the sockets.
        self._devices = nccl.DeviceGroups(
            node_id, nccl.backend_for(device) if device is not None else nccl.GLOO)

    def wait_alone(self) -> None:
        """A private world of one, so the script can build its DDP before it is admitted."""
        regroup.destroy()
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)

    def alone(self) -> Groups:
        """A private world of one (its groups on a store of its own), for a save that no
        other node of the failed group shares."""
        regroup.destroy()
        self.groups = regroup.init_generation(HashStore(), 0, 1, device=self.device)
        return self.groups

    def forget(self) -> None:
        """Before a generation's groups form: nothing held serves it yet."""
        self._held.groups = None
        self._devices.drop()

    def form(self, gen: int, nodes: tuple[str, ...], store: Store, rank: int, world_size: int,
             init_timeout: timedelta) -> None:
        """`gen`'s groups on `store` (its own prefix), held for the heartbeat; a rank missing
        past `init_timeout` raises the init's DistError, with nothing held."""
        before = sever.socket_fds()
        self.groups = regroup.init_generation(store, rank, world_size, device=self.device,
                                              init_timeout=init_timeout)
        self._held.formed(gen, nodes, before)
        self._devices.add(dist.group.WORLD)

    def kept(self, gen: int) -> None:
        """A kept plan: the groups serve `gen` too."""
        self._held.kept(gen)

    def adopt(self, gen: int, before: Iterable[int], group: dist.ProcessGroup | None) -> None:
        """A group made in `gen` after its groups formed (inprocess.user_groups)."""
        self._held.adopt(gen, before)
        self._devices.add(group)

    def learn(self, gen: int,
              listeners: Callable[[int, list[str]], Mapping[str, str]]) -> bool:
        """The heartbeat thread's: what `gen`'s peers published, kept for a sever after the
        store is gone (sever.Held.learn)."""
        return self._held.learn(gen, listeners)

    def end_failed(self, gen: int,
                   listeners: Callable[[int, list[str]], Mapping[str, str]]
                   ) -> dict[str, Any] | None:
        """The heartbeat thread's, once `gen` failed: if these groups serve it, shut down
        their gloo pairs and abort their NCCL communicators, so a collective blocked on a peer
        gone dark fails now instead of at its timeout. What was ended (None: not these)."""
        severed = self._held.sever(gen, listeners)
        if severed is None:
            return None
        ended: dict[str, Any] = {"sockets": severed}
        if self._devices.on_device:
            ended["nccl_groups_aborted"] = self._devices.abort(gen)
        return ended

    def abort(self, gen: int) -> None:
        """The training thread's, recovering from `gen`'s failure: a gloo side group may have
        failed first while NCCL kernels still wait on the lost peer; the destroy would wait
        for them."""
        self._devices.abort(gen)

    def release(self, model: nn.Module | None = None) -> None:
        """Leave the current groups and free them now (gloo closes its sockets only when the
        last reference goes: DDP's Reducer holds one, the side groups are more)."""
        if isinstance(model, DDP):
            rewrap.release_ddp(model)
        self.groups = None
        self._devices.drop()
        regroup.destroy()
        gc.collect()
